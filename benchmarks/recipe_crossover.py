"""SFT alone, the SFT-then-MOPD recipe and MOPD alone as whole `make run` jobs: where on-policy distillation pays.

    .venv/bin/python benchmarks/recipe_crossover.py [--config configs/local_cpu.yaml] [--steps 1800]
        [--interval 300] [--arms sft,recipe,mopd] [--out-dir runs/crossover] [--parallel 1] [--report]
        [--sampled K] [--temperatures 0.6,1.0]

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
`--report` runs no job: it reads the arms' run directories as they are. `--sampled K` also scores each arm's final
student (`student_final`) on the same held-out prompts with K samples per prompt at each of `--temperatures`
(mean@K: the share of the K·n completions that are right; transformers' sampling, seed 0): the metric that reads
the student's whole distribution, where the reverse KL's mode seeking would show if it paid (README "Distillation
fidelity"). The evaluation is in this process, on one thread.
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


def sampled_accuracy(
    config: Path, student: Path, k: int, temperatures: list[float]
) -> dict[str, dict[str, float]]:
    """route → {"greedy", "T=<t>"...: accuracy in [0, 1]} of the HF model at `student` on `config`'s held-out
    prompts: greedy pass@1, and mean@k at each temperature (top_p 1, rollout.sampling.max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mopd_hpc.config import RunConfig
    from mopd_hpc.data.chat import encode_prompt
    from mopd_hpc.roles.env import with_absolute_paths
    from mopd_hpc.trainer.data_setup import build_run_data

    torch.set_num_threads(1)
    cfg = with_absolute_paths(RunConfig.from_yaml(config), {"MOPD_SUBMIT_DIR": str(REPO)})
    data = build_run_data(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    model = AutoModelForCausalLM.from_pretrained(student).eval()
    out: dict[str, dict[str, float]] = {}
    for route, prompts in data.eval_prompts.items():
        ids = [list(encode_prompt(tok, p)) for p in prompts]
        width = max(map(len, ids))
        x = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        out[route] = {}
        for t in [0.0, *temperatures]:
            n = k if t > 0 else 1
            torch.manual_seed(0)
            with torch.inference_mode():
                gen = model.generate(
                    x.repeat_interleave(n, 0),
                    attention_mask=mask.repeat_interleave(n, 0),
                    max_new_tokens=cfg.rollout.sampling.max_new_tokens,
                    do_sample=t > 0,
                    temperature=t if t > 0 else None,
                    top_p=1.0,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                )
            texts = tok.batch_decode(gen[:, width:], skip_special_tokens=True)
            right = [data.score(prompts[j // n], text) == 1.0 for j, text in enumerate(texts)]
            out[route]["greedy" if t == 0 else f"T={t}"] = sum(right) / len(right)
    return out


def format_sampled(sampled: dict[str, dict[str, dict[str, float]]], k: int) -> str:
    """One line per arm: each route's greedy pass@1 and mean@k per temperature, in %."""
    lines = [f"final students, greedy pass@1 and mean@{k} (% right, not of the teacher):"]
    for arm, routes in sampled.items():
        cells = "  ".join(
            f"{route} " + " / ".join(f"{name} {100 * v:.1f}" for name, v in accs.items())
            for route, accs in routes.items()
        )
        lines.append(f"  {arm:<8} {cells}")
    return "\n".join(lines)


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
    parser.add_argument(
        "--sampled", type=int, default=0, metavar="K", help="mean@K of the final students (0: off)"
    )
    parser.add_argument("--temperatures", default="0.6,1.0", help="the temperatures of --sampled")
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
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    sampled = {
        arm: sampled_accuracy(args.config, args.out_dir / arm / "student_final", args.sampled, temperatures)
        for arm in arms
        if args.sampled > 0
    }
    if sampled:
        print(format_sampled(sampled, args.sampled))
    RESULTS.mkdir(parents=True, exist_ok=True)  # the PNG first, then the JSON (write_results: atomic)
    plot(curves, RESULTS / "recipe_crossover.png", args.steps)
    out = RESULTS / "recipe_crossover.json"
    # --report reads jobs an earlier commit ran: the record keeps that commit, and names this one beside it
    jobs_commit = json.loads(out.read_text()).get("commit") if args.report and out.is_file() else None
    record = {
        "commit": jobs_commit or commit_of(),
        "report_commit": commit_of() if args.report else None,
        "config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config),
        "steps": args.steps,
        "interval": args.interval,
        "parallel": args.parallel,
        "arms": {arm: {"sft_warmup_ratio": ARMS[arm] or "the config's", **curves[arm]} for arm in arms},
        "final_sampled": {"k": args.sampled, "seed": 0, "accuracy": sampled} if sampled else None,
    }
    print(f"wrote {RESULTS / 'recipe_crossover.png'}")
    return write_results(out, record)


if __name__ == "__main__":
    sys.exit(main())
