"""SFT alone, the SFT-then-MOPD recipe and MOPD alone as whole `make run` jobs: where on-policy distillation pays.

    .venv/bin/python benchmarks/recipe_crossover.py [--config configs/local_cpu.yaml] [--steps 1800]
        [--interval 300] [--arms sft,recipe,mopd] [--out-dir runs/crossover] [--parallel 1] [--report]

Each arm is one `mopd-submit CONFIG --local --run-dir OUT_DIR/ARM --set steps=N --set data.eval.interval=I` that
differs from the others in `loss.sft_warmup_ratio` only:

    sft     1.0   every step SFT on the route teachers' greedy answers (trainer/sft_warmup.py)
    recipe  the config's (configs/local_cpu.yaml: 0.5): SFT steps, then topk MOPD
    mopd    null  topk MOPD from step 1

Same start, seed, prompt stream, batch, lr and schedule (`benchmarks/fidelity.py` compares the methods in one
process at an equal CPU budget, early in training; this compares them over a whole run). Reads each run's
eval.json (greedy pass@1 per route at the start, every I steps and at the end) and metrics.jsonl (the step lines'
timestamps: the job's seconds from its first step, evaluations included; on a shared machine they count the
other jobs' time too, and `--parallel 2` runs two arms at once), and writes benchmarks/results/
recipe_crossover.json and recipe_crossover.png (% of the teacher per route against steps). Prints a table.
`--report` runs no job: it reads the arms' run directories as they are.
Exit status: 0, or 1 when an arm's job failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_plot import figure, percent_axis, save  # noqa: E402
from results_file import commit_of, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: arm → its loss.sft_warmup_ratio override (None: the config's own)
ARMS: dict[str, str | None] = {"sft": "1.0", "recipe": None, "mopd": "null"}


def run_arm(arm: str, config: Path, out_dir: Path, steps: int, interval: int) -> int:
    """One arm's job in OUT_DIR/ARM (its stdout and stderr in OUT_DIR/ARM.log); the job's exit code."""
    sets = [f"steps={steps}", f"data.eval.interval={interval}"]
    if ARMS[arm] is not None:
        sets.append(f"loss.sft_warmup_ratio={ARMS[arm]}")
    argv = [
        str(REPO / ".venv" / "bin" / "mopd-submit"),
        str(config),
        "--local",
        "--run-dir",
        str(out_dir / arm),
    ]
    for item in sets:
        argv += ["--set", item]
    with open(out_dir / f"{arm}.log", "w") as log:
        return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, check=False).returncode


def curve(run_dir: Path) -> dict[str, Any]:
    """The arm's evaluation points: [{step, seconds, <route>: pass@1}] and the teacher's pass@1 per route."""
    record = json.loads((run_dir / "eval.json").read_text())
    ts = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        ts[row["step"]] = row["ts"]
    first = ts[min(ts)] if ts else 0.0
    points = [
        {"step": p["step"], "seconds": round(ts.get(p["step"], first) - first, 1), **p["pass@1"]}
        for p in record.get("points", [])
    ]
    teacher = {route: r["teacher"] for route, r in record["routes"].items()}
    return {"points": points, "teacher": teacher}


def pct(value: float, teacher: float) -> float:
    return 100 * value / teacher if teacher else 0.0


def format_table(curves: dict[str, dict[str, Any]]) -> str:
    routes = sorted(next(iter(curves.values()))["teacher"])
    head = f"{'arm':<8} {'step':>6} {'job s':>7} " + " ".join(f"{r + ' % of t.':>14}" for r in routes)
    lines = [head, "-" * len(head)]
    for arm, c in curves.items():
        for p in c["points"]:
            cells = " ".join(f"{pct(p[r], c['teacher'][r]):>13.1f}%" for r in routes)
            lines.append(f"{arm:<8} {p['step']:>6} {p['seconds']:>7} {cells}")
    return "\n".join(lines)


def plot(curves: dict[str, dict[str, Any]], path: Path, steps: int) -> None:
    """% of the teacher per route against steps, one line per arm."""
    routes = sorted(next(iter(curves.values()))["teacher"])
    fig, axes = figure(1, len(routes), (5.5 * len(routes), 4))
    for col, route in enumerate(routes):
        ax = axes[0][col]
        for arm, c in curves.items():
            xs = [p["step"] for p in c["points"]]
            ax.plot(xs, [pct(p[route], c["teacher"][route]) for p in c["points"]], marker="o", label=arm)
        percent_axis(ax, "step", f"{route}: greedy pass@1, % of teacher")
    save(fig, axes, path, f"benchmarks/recipe_crossover.py: {steps} steps a job, same start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local_cpu.yaml")
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--interval", type=int, default=300, help="steps between evaluations")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "crossover")
    parser.add_argument("--parallel", type=int, default=1, help="arms run at once")
    parser.add_argument("--report", action="store_true", help="no jobs: read the arms' run dirs as they are")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := sorted(set(arms) - set(ARMS)):
        parser.error(f"--arms: unknown {unknown} (known: {sorted(ARMS)})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    codes = {}
    if not args.report:
        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            runs = pool.map(lambda a: run_arm(a, args.config, args.out_dir, args.steps, args.interval), arms)
            codes = dict(zip(arms, runs, strict=True))
    if failed := {a: rc for a, rc in codes.items() if rc != 0}:
        print(f"failed arms (exit codes): {failed}; logs in {args.out_dir}", file=sys.stderr)
        return 1
    curves = {arm: curve(args.out_dir / arm) for arm in arms}
    print(format_table(curves))
    RESULTS.mkdir(parents=True, exist_ok=True)  # the PNG first, then the JSON (write_results: atomic)
    plot(curves, RESULTS / "recipe_crossover.png", args.steps)
    record = {
        "commit": commit_of(),
        "config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config),
        "steps": args.steps,
        "interval": args.interval,
        "parallel": args.parallel,
        "arms": {arm: {"sft_warmup_ratio": ARMS[arm] or "the config's", **curves[arm]} for arm in arms},
    }
    print(f"wrote {RESULTS / 'recipe_crossover.png'}")
    return write_results(RESULTS / "recipe_crossover.json", record)


if __name__ == "__main__":
    sys.exit(main())
