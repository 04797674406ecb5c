"""`plot_summary(summary, path)`: a PNG of losses, reverse KL and per-route accuracy over steps (matplotlib,
Agg backend: no display needed). Series are the bounded, down-sampled ones of `Progress`."""

from __future__ import annotations

import os
from pathlib import Path

from mopd_hpc.logs.summary import RunSummary
from mopd_hpc.records.metrics_schema import ACCURACY_PREFIX, LOSS_KEYS


class PlotError(ValueError):
    """Nothing to plot (no metrics) or the PNG cannot be written."""


def plot_summary(summary: RunSummary, path: str | os.PathLike[str]) -> Path:
    """Write three panels (losses; reverse KL; accuracy per route) to `path` as PNG; returns the path.

    Raises:
        PlotError: the run has no metrics lines, or writing failed (the message names the path).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    series = summary.progress.series
    if summary.progress.n_lines == 0:
        raise PlotError(f"run {summary.run_dir} has no metrics.jsonl lines: nothing to plot to {path}")
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    panels = (
        ("loss", [k for k in LOSS_KEYS if k in series]),
        ("reverse KL (nats/token)", [k for k in ("mopd/reverse_kl",) if k in series]),
        ("accuracy", sorted(k for k in series if k.startswith(ACCURACY_PREFIX))),
    )
    for ax, (label, keys) in zip(axes, panels, strict=True):
        for key in keys:
            steps, values = zip(*series[key], strict=True) if series[key] else ((), ())
            ax.plot(steps, values, label=key)
        ax.set_ylabel(label)
        if keys:
            ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"job {summary.job.job_id or '?'}: {summary.run_dir}", fontsize="small")
    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, format="png", dpi=100)
    except OSError as exc:
        raise PlotError(f"cannot write plot {out}: {exc}") from None
    finally:
        plt.close(fig)
    return out
