"""The actor group at DP = 2 against DP = 1 on this machine: seconds per step and per phase, and how far apart the
two runs' losses and final weights are.

Runs `mopd-submit configs/local_cpu_dp2.yaml --local` twice in fresh run directories (the tiny models of
`make run`, built on first use under .cache/models): once as shipped (cluster.group.actor_ranks_per_node 2:
two actor ranks of one gloo world, DP = 2) and once at actor_ranks_per_node 1 (DP = 1), with the same seed and
global batch, `--steps` steps, evaluation off; the pair `--repeats` times, alternating. From each run's
metrics.jsonl: the median seconds per step (between consecutive metrics lines, the first `--warmup` steps
left out) and the median seconds of each phase; per DP size the run with the lowest median is reported (the
machine is shared: the others were slowed by other work; every run's median is kept in the JSON); the largest
relative difference of a pair's per-step `loss/total`; the largest |Δw| of its student_final.

    .venv/bin/python benchmarks/actor_dp.py [--steps 20] [--warmup 3] [--batch-size 128] [--repeats 3]

Prints a table and writes benchmarks/results/actor_dp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import write_results
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local_cpu_dp2.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "actor_dp.json"
PHASES = ("rollout", "teacher", "drain", "train", "sync")


def run(ranks: int, run_dir: Path, steps: int, batch_size: int) -> list[dict]:
    """One local run at `ranks` actor ranks; its metrics lines."""
    sets = [f"steps={steps}", "data.eval.size=0", f"data.batch_size={batch_size}"]
    sets += [f"cluster.group.actor_ranks_per_node={ranks}", f"checkpoint_interval={steps}"]
    argv = [sys.executable, "-m", "mopd_hpc.cli.submit", str(CONFIG), "--local", "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"DP = {ranks} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def timings(lines: list[dict], warmup: int) -> dict[str, float]:
    kept = lines[warmup:]
    step_s = [b["ts"] - a["ts"] for a, b in zip(kept, kept[1:], strict=False)]
    out = {"step_s": statistics.median(step_s)}
    for phase in PHASES:
        out[f"{phase}_s"] = statistics.median(line[f"time/{phase}_s"] for line in kept)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    loss_rel, max_dw = 0.0, 0.0
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="actor_dp_") as tmp:
            lines = {r: run(r, Path(tmp) / f"dp{r}", args.steps, args.batch_size) for r in (1, 2)}
            weights = {
                r: load_file(Path(tmp) / f"dp{r}" / "student_final" / "model.safetensors") for r in (1, 2)
            }
        for r in (1, 2):
            runs[r].append(timings(lines[r], args.warmup))
        loss_rel = max(
            loss_rel,
            *(
                abs(a["loss/total"] - b["loss/total"]) / abs(a["loss/total"])
                for a, b in zip(lines[1], lines[2], strict=True)
            ),
        )
        max_dw = max(max_dw, *(float((weights[1][k] - weights[2][k]).abs().max()) for k in weights[1]))
    times = {r: min(runs[r], key=lambda t: t["step_s"]) for r in (1, 2)}
    print(f"{'DP':>3} {'s/step':>8} " + " ".join(f"{p + ' s':>10}" for p in PHASES))
    for r in (1, 2):
        print(
            f"{r:>3} {times[r]['step_s']:>8.3f} " + " ".join(f"{times[r][p + '_s']:>10.3f}" for p in PHASES)
        )
    print(f"loss/total: largest relative difference {loss_rel:.2e}; final weights: largest |Δw| {max_dw:.2e}")
    return write_results(
        RESULTS,
        {
            "config": str(CONFIG.relative_to(REPO)),
            "steps": args.steps,
            "warmup": args.warmup,
            "batch_size": args.batch_size,
            "cpus": len(os.sched_getaffinity(0)),
            "machine": platform.processor() or platform.machine(),
            "repeats": args.repeats,
            "dp1": times[1],
            "dp2": times[2],
            "dp1_step_s_all": [t["step_s"] for t in runs[1]],
            "dp2_step_s_all": [t["step_s"] for t in runs[2]],
            "loss_rel_diff_max": loss_rel,
            "weights_abs_diff_max": max_dw,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
