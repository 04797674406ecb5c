"""`plot_summary(summary, path)`: a PNG of losses, reverse KL, per-route rollout accuracy and, when the run took
evaluation points during training (data.eval.interval), the held-out pass@1 and mean@k per route over steps
(matplotlib, Agg backend: no display needed). Series are the bounded, down-sampled ones of `Progress`."""

from __future__ import annotations

import os
from pathlib import Path

from mopd_hpc.logs.summary import RunSummary
from mopd_hpc.records.metrics_schema import ACCURACY_PREFIX, EVAL_PREFIX, LOSS_KEYS


class PlotError(ValueError):
    """Nothing to plot (no metrics) or the PNG cannot be written."""


def plot_summary(summary: RunSummary, path: str | os.PathLike[str]) -> Path:
    """Write three panels (losses; reverse KL; accuracy per route), and a fourth of the held-out evaluation
    points (`eval/pass@1/<route>`, `eval/mean@k/<route>`, dots) when the metrics have any, to `path` as PNG;
    returns the path.

    Raises:
        PlotError: the run has no metrics lines, or writing failed (the message names the path).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    series = summary.progress.series
    if summary.progress.n_lines == 0:
        raise PlotError(f"run {summary.run_dir} has no metrics.jsonl lines: nothing to plot to {path}")
    panels = [
        ("loss", [k for k in LOSS_KEYS if k in series]),
        ("reverse KL (nats/token)", [k for k in ("mopd/reverse_kl",) if k in series]),
        ("accuracy", sorted(k for k in series if k.startswith(ACCURACY_PREFIX))),
    ]
    held_out = sorted(k for k in series if k.startswith(EVAL_PREFIX))
    if held_out:
        panels.append(("held-out eval", held_out))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True)
    for ax, (label, keys) in zip(axes, panels, strict=True):
        for key in keys:
            steps, values = zip(*series[key], strict=True) if series[key] else ((), ())
            ax.plot(steps, values, label=key, marker="o" if key in held_out else None)
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
