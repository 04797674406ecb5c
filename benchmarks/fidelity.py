"""Fidelity at an equal budget: MOPD (topk, sampled, with the RL term, after an SFT warm-up) vs SFT on teacher samples.

    .venv/bin/python benchmarks/fidelity.py [--config configs/local_cpu.yaml] [--budget-s 60] [--evals 3]
        [--methods sft,topk,sampled,topk_rl,sft_topk] [--quick]

Every method starts from the same student (the config's actor, seed) and the same prompt stream, and runs
each setting of its own small sweep (`SWEEPS`: the lr, and the method's own knob: warm-up steps, RL
coefficient) for the same budget; the best setting (the highest mean % of the teacher over the routes at
the end of the budget) is the method's tuned result. Steps are `benchmarks/fidelity_steps.py`'s, built from
the project's parts (the hf rollout engine's sampler with μ, the teachers' scoring engines, the teachers'
greedy route, `TorchTrainEngine` with its loss bound; SFT through `TrainBatch.sft`, the package's warm-up step).

The budget axis is this process's CPU time (`time.process_time`: user + system of every thread, torch pinned
to one thread), not the wall clock: on a machine shared with other jobs the wall clock counts their time
too, the CPU time does not; on a quiet machine with one thread the two are equal. Both are recorded at every
point (`cpu_s`, `wall_s`), with the steps and the response tokens trained on (`tokens`: the student's
samples, or the teacher's answers for SFT steps), so the curves can be read at an equal budget and at equal
tokens. The evaluations (greedy accuracy on the config's held-out prompts, in process) are excluded from
both clocks. The SFT baseline generates its teacher answers on the fly and that time counts (offline data
would make its steps cheaper still).

Writes benchmarks/results/fidelity.json (every sweep setting and its curve, the tuned setting per method,
the table) and benchmarks/results/fidelity.png (accuracy against the CPU budget and against the tokens, per
route, the tuned setting of each method). Timing goals are asserted nowhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_plot import figure, percent_axis, save  # noqa: E402
from fidelity_steps import REPO, Bench, Learner, Setting  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"

#: Each method's sweep (the same budget for every setting).
SWEEPS: dict[str, list[Setting]] = {
    "sft": [Setting("sft", 2e-3)],
    "topk": [Setting("topk", 2e-3), Setting("topk", 4e-3)],
    "sampled": [
        Setting("sampled", 3e-4)
    ],  # its calibrated lr (collapses at 1e-3: reference/tiny_calibration.md)
    "topk_rl": [Setting("topk_rl", 2e-3, rl=1.0, n=4)],
    # the recipe: SFT steps first, then topk (make run: half its steps; at --budget-s 120 ≈ 200 of ≈ 350)
    "sft_topk": [Setting("sft_topk", 2e-3, warmup=50), Setting("sft_topk", 2e-3, warmup=200)],
}


def run_setting(bench: Bench, setting: Setting, budget_s: float, evals: int) -> dict[str, Any]:
    """Train `setting` for `budget_s` CPU seconds; the accuracy at `evals` marks along it."""
    learner = Learner(bench, setting)
    curve = [{"cpu_s": 0.0, "wall_s": 0.0, "steps": 0, "tokens": 0, **learner.accuracy()}]
    marks = [budget_s * (i + 1) / evals for i in range(evals)]
    cpu = wall = 0.0
    while marks:
        c0, w0 = time.process_time(), time.perf_counter()
        learner.step()
        cpu += time.process_time() - c0
        wall += time.perf_counter() - w0
        if cpu >= marks[0]:
            marks.pop(0)
            point = {
                "cpu_s": round(cpu, 1),
                "wall_s": round(wall, 1),
                "steps": learner.steps,
                "tokens": learner.tokens,
            }
            curve.append(point | learner.accuracy())
            print(f"  {setting.label()}: {point} {curve[-1]}", flush=True)
    return {"setting": setting.record(), "label": setting.label(), "curve": curve}


def score(result: dict[str, Any], teacher: dict[str, float]) -> float:
    """Mean over the routes of the end point's % of the teacher."""
    end = result["curve"][-1]
    return sum(pct(end[r], teacher[r]) for r in teacher) / len(teacher)


def pct(student: float, teacher: float) -> float:
    """The student's accuracy as a % of the teacher's (0 for a teacher at 0)."""
    return 100 * student / teacher if teacher else 0.0


def format_table(best: dict[str, dict[str, Any]], teacher: dict[str, float]) -> str:
    routes = list(teacher)
    head = f"{'method':<44} {'CPU s':>6} {'steps':>6} {'tokens':>7} " + " ".join(
        f"{r + ' % of t.':>14}" for r in routes
    )
    lines = [head, "-" * len(head)]
    lines.append(
        f"{'teacher (greedy accuracy)':<44} {'':>6} {'':>6} {'':>7} "
        + " ".join(f"{100 * teacher[r]:>13.1f}%" for r in routes)
    )
    for res in best.values():
        for p in res["curve"][1:]:
            cells = " ".join(f"{pct(p[r], teacher[r]):>13.1f}%" for r in routes)
            lines.append(f"{res['label']:<44} {p['cpu_s']:>6} {p['steps']:>6} {p['tokens']:>7} {cells}")
    return "\n".join(lines)


def plot(best: dict[str, dict[str, Any]], teacher: dict[str, float], path: Path, budget_s: float) -> None:
    """Accuracy (% of the teacher) per route against CPU seconds and against tokens, one line per method."""
    routes = list(teacher)
    fig, axes = figure(len(routes), 2, (11, 4 * len(routes)))
    for row, route in enumerate(routes):
        for col, (key, name) in enumerate(
            (("cpu_s", "CPU seconds (1 thread)"), ("tokens", "response tokens trained on"))
        ):
            ax = axes[row][col]
            for res in best.values():
                xs = [p[key] for p in res["curve"]]
                ys = [pct(p[route], teacher[route]) for p in res["curve"]]
                ax.plot(xs, ys, marker="o", label=res["label"])
            percent_axis(ax, name, f"{route}: greedy accuracy, % of teacher")
    save(
        fig,
        axes,
        path,
        f"benchmarks/fidelity.py: tuned setting per method, {budget_s:g} CPU s each, same start",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local_cpu.yaml")
    parser.add_argument("--budget-s", type=float, default=60.0, help="CPU seconds per setting")
    parser.add_argument("--evals", type=int, default=3, help="evaluations along the budget")
    parser.add_argument("--methods", default=",".join(SWEEPS))
    parser.add_argument("--quick", action="store_true", help="the first setting of each sweep only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bench = Bench(args.config)
    teacher = bench.teacher_acc
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for method in args.methods.split(","):
        settings = SWEEPS[method][:1] if args.quick else SWEEPS[method]
        sweeps[method] = [run_setting(bench, s, args.budget_s, args.evals) for s in settings]
        for res in sweeps[method]:
            res["score"] = round(score(res, teacher), 2)
    best = {m: max(rs, key=lambda r: r["score"]) for m, rs in sweeps.items()}
    table = format_table(best, teacher)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / "fidelity.png"
    plot(best, teacher, png, args.budget_s)
    record = {
        "config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config),
        "budget": {"cpu_s": args.budget_s, "axis": "time.process_time of this process, torch on 1 thread"},
        "evals": args.evals,
        "batch_size": bench.cfg.data.batch_size,
        "teacher": teacher,
        "selection": "highest mean % of the teacher over the routes at the end of the budget",
        "tuned": {m: r["setting"] for m, r in best.items()},
        "sweeps": sweeps,
        "table": table,
        "plot": str(png.relative_to(REPO)),
    }
    (RESULTS / "fidelity.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS / 'fidelity.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
