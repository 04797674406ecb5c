"""Training progress for humans: a rich progress bar on a terminal, plain log lines otherwise.

The line (or the bar's description) shows the step, the total loss, the reverse-KL estimate, the mean
accuracy of the step's rollouts per route, and seconds per step. Plain lines are printed every
`every` steps and on the last step (a guard child's stdout is a log file, where a bar would be noise).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, TextIO

#: Plain-text lines per run at most (about): the period is steps // LINES_PER_RUN.
LINES_PER_RUN = 100


def summary_line(step: int, total: int, values: Mapping[str, Any], step_s: float) -> str:
    """`step 12/200  loss 0.512  kl 1.203  acc chain 41% legs 55%  0.41 s/step`; an SFT warm-up step
    (`loss/sft` in its line, its `mopd/*` values null) shows `sft` in place of the reverse KL."""
    acc = "  ".join(
        f"{k.removeprefix('accuracy/')} {100 * v:.0f}%"
        for k, v in values.items()
        if k.startswith("accuracy/") and isinstance(v, float) and v == v
    )
    kl = values.get("mopd/reverse_kl")
    kl_text = "sft" if "loss/sft" in values else f"kl {_number(kl):.4f}"
    return (
        f"step {step}/{total}  loss {_number(values.get('loss/total')):.4f}  "
        f"{kl_text}  acc {acc}  {step_s:.2f} s/step"
    )


def _number(value: Any) -> float:
    """A metrics value as a float: NaN for a missing or null one."""
    return float("nan") if value is None else float(value)


class Progress:
    """Reports steps `start+1..total` to `out`. Use as a context manager."""

    def __init__(self, out: TextIO, start: int, total: int, every: int | None = None) -> None:
        self.out, self.start, self.total = out, start, total
        self.every = every or max(1, total // LINES_PER_RUN)
        self._bar: Any = None
        self._task: Any = None
        self._last = time.perf_counter()

    def __enter__(self) -> Progress:
        if self.out.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("[bold]MOPD"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self.out),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("", total=self.total, completed=self.start)
        return self

    def update(self, step: int, values: Mapping[str, Any], step_s: float | None = None) -> None:
        """Show `step` (its metrics line `values`); step_s: its duration (default: since the last update)."""
        now = time.perf_counter()
        step_s, self._last = (now - self._last if step_s is None else step_s), now
        line = summary_line(step, self.total, values, step_s)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=line.split("  ", 1)[1])
        elif step % self.every == 0 or step == self.total or step == self.start + 1:
            print(line, file=self.out, flush=True)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None
