"""Seconds per phase of the job's step through its roles on one GPU, against each phase's floor (issues 22, 35).

    python benchmarks/gpu_step_roles.py --shapes 32x4x128@0.6b,64x4x1024@0.6b --steps 5 --out $OUT/a.json
    python benchmarks/gpu_step_roles.py --shapes 32x4x128@0.6b --config configs/local_gpu_colocated_awex.yaml
    python benchmarks/gpu_step_roles.py --merge a.json b.json                # fold results files into --out

A shape is PROMPTSxSAMPLESxNEW_TOKENS@SIZE (SIZE: 0.6b or 1.7b, random Qwen3 shapes). Each runs
`mopd-submit CONFIG --local`, by default `configs/local_gpu_colocated.yaml` as shipped (the megatron actor
and teacher, the rollout backend and weight sync it names — sglang + ipc since issue 35 —, all on GPU 0) with
the overrides of `gpu_memory.job_sets` (`data.eval.size: 0`, `--steps` steps; none changes a backend), the
models made once per size under `--models-root` by `gpu_step.py --make-models`, and the `--set`s given.
`--config configs/local_gpu_colocated_awex.yaml` runs the hf engine with AWEX colocate, the baseline before.
`--set rollout.backend=sglang` without a `--set weight_sync.backend=...` also sets the weight sync that
connects an actor and a colocated sglang engine on one GPU (`implied_sets`: ipc, from
config/capabilities.py), recorded as `implied_sets`.
Each record names its config and the rollout backend and weight sync that ran (`backends`, from the run's
resolved `config.yaml`), and is keyed SHAPE/ROLLOUT+SYNC (`result_key`), so runs of both backends share one
file. From the run's metrics.jsonl, steps 2.. (step 1 is the warm-up): seconds per phase (`time/<phase>_s`,
median), the step's tokens (`train/prompt_tokens`, `train/response_tokens`), peak reserved GiB per child and
phase (`gpu_memory.child_peaks`, every step; an sglang engine's from the driver over its process tree,
engines/rollout/tree_memory.py, so the release between phases shows). Then, in this process, once the job
has exited (the GPU its own again): the HBM bandwidth (a 4 GiB device-to-device copy,
`weight_sync.copy_gbps`; HBM traffic is twice the bytes copied) and the bf16 matmul peak (8192³ GEMMs,
`scoring_mfu.peak_bf16_tflops`). Floors per phase from those (`step_floors.py`), `phase_floor_ratio` per
phase and `step_floor_ratio` (the step's seconds over the sum of its floors; issue 35 asks ≤ 5 at every
shape and no phase above 10×).

The results file (`--out`) keeps the records it has and replaces those run again (so one device call per
shape and backend builds it up); it is rewritten after each shape. A run stopped by `--deadline-s` reports the
steps it finished. Prints one table per shape.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_memory import CONFIG, child_peaks, job_sets, measured_totals, plan_against, run_job  # noqa: E402
from gpu_models import ensure_models  # noqa: E402
from results_file import commit_of, write_results  # noqa: E402
from step_floors import PHASES, Device, ModelShape, StepTokens, floor_ratios, phase_floors  # noqa: E402

from mopd_hpc.config.capabilities import WEIGHT_SYNCS  # noqa: E402
from mopd_hpc.records.run_dir import CONFIG_FILE  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = ("0.6b", "1.7b")
DEFAULT_SHAPES = ("32x4x128@0.6b", "64x4x1024@0.6b", "32x4x128@1.7b", "64x4x1024@1.7b")
#: Bytes of the device-to-device copy that measures the bandwidth, and seconds kept for it at the end.
COPY_BYTES = 4 << 30
#: Seconds kept for the job's stop (SIGTERM 20 s, then SIGKILL 10 s), the idle wait and the measurement.
MEASURE_RESERVE_S = 45.0
#: The bandwidth is measured once this fraction of the GPU's memory is free, waiting at most IDLE_WAIT_S.
IDLE_FREE_FRACTION = 0.9
IDLE_WAIT_S = 10.0
_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)@(\S+)$")


@dataclass(frozen=True, slots=True)
class Shape:
    """One benchmark case: `prompts` × `samples` rows, `new_tokens` sampled per row, the model `size`."""

    prompts: int
    samples: int
    new_tokens: int
    size: str

    @classmethod
    def parse(cls, text: str) -> Shape:
        """From PROMPTSxSAMPLESxNEW@SIZE, e.g. 32x4x128@0.6b. Raises ValueError naming the text."""
        m = _SHAPE.match(text.strip())
        if not m:
            raise ValueError(f"shape {text!r}: expected PROMPTSxSAMPLESxNEW_TOKENS@SIZE, e.g. 32x4x128@0.6b")
        prompts, samples, new, size = int(m[1]), int(m[2]), int(m[3]), m[4].lower()
        if size not in SIZES:
            raise ValueError(f"shape {text!r}: size {size!r} is not one of {list(SIZES)}")
        if min(prompts, samples, new) < 1:
            raise ValueError(f"shape {text!r}: prompts, samples and new tokens must be ≥ 1")
        return cls(prompts, samples, new, size)

    @property
    def name(self) -> str:
        return f"{self.prompts}x{self.samples}x{self.new_tokens}@{self.size}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help="comma-separated PROMPTSxSAMPLESxNEW@SIZE (default: %(default)s)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="steps per run, step 1 the warm-up (≥ 2)")
    p.add_argument("--config", type=Path, default=CONFIG,
                   help="the config to run (default: %(default)s, as shipped)")  # fmt: skip
    p.add_argument("--models-root", type=Path, default=REPO / ".cache" / "models",
                   help="the models of SIZE are ROOT/gpu_step_roles_SIZE/{student,teacher}, made when absent")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=550.0,
                   help="stop the job so that the whole call ends within this many seconds")  # fmt: skip
    p.add_argument("--keep", type=Path, default=None, help="where each shape's submit log and logs/ go")
    p.add_argument("--set", dest="extra_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a further `mopd-submit --set` for every shape (e.g. weight_sync.backend=ipc), recorded")  # fmt: skip
    p.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="fold these results files' shapes into --out and exit (no GPU)")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_step_roles.json")
    args = p.parse_args(argv)
    try:
        args.shapes = [Shape.parse(s) for s in args.shapes.split(",") if s.strip()]
    except ValueError as err:
        p.error(f"--shapes: {err}")
    if args.steps < 2:
        p.error(f"--steps: {args.steps}; expected ≥ 2 (step 1 is the warm-up, excluded)")
    return args


def _chosen(sets: Sequence[str]) -> dict[str, str]:
    """KEY → VALUE of `--set KEY=VALUE` strings (the last wins, as mopd-submit applies them)."""
    return dict(x.split("=", 1) for x in sets if "=" in x)


def implied_sets(sets: Sequence[str]) -> list[str]:
    """With rollout.backend=sglang and no weight_sync.backend among `sets`: the weight sync that connects an
    actor and a colocated sglang engine on a GPU (`WEIGHT_SYNCS`; the shipped AWEX does not), with
    `weight_sync.awex_mode=null` (the shipped `colocate` is AWEX's only); else []."""
    chosen = _chosen(sets)
    if chosen.get("rollout.backend") != "sglang" or "weight_sync.backend" in chosen:
        return []
    sync = next(n for n, s in WEIGHT_SYNCS.items()
                if "sglang" in s.rollout_backends and ("colocated", "gpu") in s.layouts)  # fmt: skip
    return [f"weight_sync.backend={sync}", "weight_sync.awex_mode=null"]


def ran_backends(run_dir: Path, sets: Sequence[str], config: Path = CONFIG) -> dict[str, str]:
    """The rollout backend, rollout mode and weight sync the job ran: its resolved `run_dir/config.yaml`, or,
    when the job wrote none, `config` with `sets` applied to those fields ("source" says which)."""
    import yaml

    resolved = run_dir / CONFIG_FILE
    doc = yaml.safe_load((resolved if resolved.exists() else config).read_text())
    out = {"rollout": doc["rollout"]["backend"], "rollout_mode": doc["rollout"]["mode"],
           "weight_sync": doc["weight_sync"]["backend"],
           "source": "run_dir/config.yaml" if resolved.exists() else f"{config.name} + --set"}  # fmt: skip
    if not resolved.exists():
        chosen = _chosen(sets)
        for field, key in (("rollout", "rollout.backend"), ("rollout_mode", "rollout.mode"),
                           ("weight_sync", "weight_sync.backend")):  # fmt: skip
            out[field] = chosen.get(key, out[field])
    return out


def result_key(shape: Shape, backends: dict[str, str]) -> str:
    """SHAPE/ROLLOUT+SYNC, e.g. 32x4x128@0.6b/hf+awex: one record per shape and backend pair."""
    return f"{shape.name}/{backends['rollout']}+{backends['weight_sync']}"


def _shown(config: Path) -> str:
    """`config` relative to the repository where it is inside it."""
    config = config.resolve()
    return str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config)


def models_for(root: Path, size: str) -> Path:
    """ROOT/gpu_step_roles_SIZE with student/ and teacher/ (made by gpu_models.py when absent)."""
    return ensure_models(root / f"gpu_step_roles_{size.replace('.', '_')}", size, timeout_s=None)


def wait_for_idle_gpu(timeout_s: float = IDLE_WAIT_S) -> float:
    """Wait until GPU 0 has IDLE_FREE_FRACTION of its memory free (a job stopped at its deadline may still be
    tearing its children down: a copy beside them measured 1,934 of ~4,250 GB/s on the H200), at most
    `timeout_s`; returns the GiB free when measured (recorded beside the figures)."""
    import torch

    deadline = time.monotonic() + timeout_s
    while True:
        free, total = torch.cuda.mem_get_info(0)
        if free >= IDLE_FREE_FRACTION * total or time.monotonic() > deadline:
            return free / 2**30
        time.sleep(1.0)


def measure_device() -> dict[str, Any]:
    """This process's GPU 0, once idle (`wait_for_idle_gpu`): name, copy rate and HBM traffic (GB/s), bf16
    matmul peak (TFLOP/s), its memory and what was free when measured (GiB)."""
    import torch
    from scoring_mfu import peak_bf16_tflops
    from weight_sync import copy_gbps

    torch.cuda.set_device(0)
    free_gib = wait_for_idle_gpu()
    copy = copy_gbps(COPY_BYTES)
    peak = peak_bf16_tflops()
    torch.cuda.empty_cache()
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "copy_gbps": round(copy, 1),
            "hbm_gbps": round(2 * copy, 1), "peak_bf16_tflops": round(peak, 1),
            "gpu_capacity_gib": round(capacity, 3), "free_gib_when_measured": round(free_gib, 2)}  # fmt: skip


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(shape: Shape, lines: list[dict[str, Any]], student: ModelShape, teacher: ModelShape,
              device: Device) -> dict[str, Any]:  # fmt: skip
    """The figures of one run's metrics lines (module docstring); `measured` None when no step after the
    first finished."""
    measured = [x for x in lines if x["step"] >= 2]
    out: dict[str, Any] = {
        "steps_done": len(lines),
        "measured_steps": [x["step"] for x in measured],
        "seconds_per_phase_all_steps": {
            ph: [round(x.get(f"time/{ph}_s", float("nan")), 4) for x in lines] for ph in PHASES
        },  # fmt: skip
        "peak_reserved_gib": child_peaks(lines),
        "measured_gpu_gib_per_phase": measured_totals(lines),
        "params": {"student": student.params, "teacher": teacher.params},
        "measured": None,
    }
    if not measured:
        return out
    seconds = {ph: statistics.median(x.get(f"time/{ph}_s", 0.0) for x in measured) for ph in PHASES}
    step_s = statistics.median(sum(x.get(f"time/{ph}_s", 0.0) for ph in PHASES) for x in measured)
    tokens = StepTokens(
        rows=shape.prompts * shape.samples, samples_per_prompt=shape.samples, new_tokens=shape.new_tokens,
        prompt_tokens=round(statistics.median(x.get("train/prompt_tokens", 0.0) for x in measured)),
        response_tokens=round(statistics.median(x.get("train/response_tokens", 0.0) for x in measured)),
    )  # fmt: skip
    floors = phase_floors(student, teacher, tokens, device)
    ratios = floor_ratios(seconds, floors)
    walls = [b["ts"] - a["ts"] for a, b in zip(lines, lines[1:], strict=False) if b["step"] >= 2]
    out["measured"] = {
        "seconds_per_phase": {ph: round(v, 4) for ph, v in seconds.items()},
        # the phases' own split where the run records one (time/train/forward_backward_s, time/sync/...)
        "seconds_within_phases": {
            key.removeprefix("time/").removesuffix("_s"): round(
                statistics.median(x[key] for x in measured), 4
            )
            for key in sorted(measured[0])
            if key.startswith(tuple(f"time/{ph}/" for ph in PHASES)) and all(key in x for x in measured)
        },  # fmt: skip
        "step_s": round(step_s, 4),
        "step_wall_s": median_or_none(walls),
        "floor_s": {ph: round(v, 6) for ph, v in floors.items()},
        "phase_floor_ratio": {
            ph: (round(r, 2) if r is not None else None) for ph, r in ratios["phase_floor_ratio"].items()
        },  # fmt: skip
        "step_floor_ratio": round(ratios["step_floor_ratio"], 2),
        "prompt_tokens": tokens.prompt_tokens,
        "response_tokens": tokens.response_tokens,
        "response_tokens_per_s": round(tokens.response_tokens / step_s, 1) if step_s > 0 else None,
    }
    return out


def one_shape(
    shape: Shape, args: argparse.Namespace, t0: float, device_info: dict | None
) -> tuple[dict, dict]:
    models = models_for(args.models_root, shape.size)
    implied = implied_sets(args.extra_sets)
    sets = (
        job_sets(models, args.steps, shape.prompts, shape.samples, shape.new_tokens)
        + args.extra_sets
        + implied
    )
    run_dir = Path(tempfile.mkdtemp(prefix=f"gpu_step_roles_{shape.name}_")) / "run"
    keep = args.keep or run_dir.parent
    keep.mkdir(parents=True, exist_ok=True)
    left = args.deadline_s - (time.perf_counter() - t0) - MEASURE_RESERVE_S
    log = keep / f"{shape.name.replace('@', '_')}_submit.log"
    code, wall = run_job(sets, run_dir, left, log, config=args.config)
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if args.keep is not None and (run_dir / "logs").is_dir():
        subprocess.run(
            ["cp", "-r", str(run_dir / "logs"), str(keep / f"{shape.name.replace('@', '_')}_logs")],
            check=False,
        )
    device_info = device_info or measure_device()
    device = Device(hbm_gbps=device_info["hbm_gbps"], peak_tflops=device_info["peak_bf16_tflops"])
    student, teacher = (ModelShape.from_hf_config(json.loads((models / m / "config.json").read_text()))
                        for m in ("student", "teacher"))  # fmt: skip
    record = {
        "shape": {
            "prompts": shape.prompts,
            "samples_per_prompt": shape.samples,
            "max_new_tokens": shape.new_tokens,
            "size": shape.size,
        },  # fmt: skip
        "config": _shown(args.config),
        "extra_sets": list(args.extra_sets),
        "implied_sets": implied,
        "backends": ran_backends(run_dir, sets, args.config),
        "exit_code": code,
        "stopped_at_deadline": code is None,
        "job_wall_s": round(wall, 1),
        "steps": args.steps,
        **device_info,
        "commit": commit_of(args.commit),
        **summarize(shape, lines, student, teacher, device),
    }
    # the memory plan of these sets at the GPU's memory (issue 21: 1 ≤ plan / measured peak ≤ 1.25)
    against = plan_against(
        sets, device_info["gpu_capacity_gib"], record["measured_gpu_gib_per_phase"], args.config
    )
    ratio = against["plan_over_measured"]
    record |= against | {"plan_over_measured": round(ratio, 3) if ratio is not None else None}
    return record, device_info


def table(name: str, r: dict[str, Any]) -> str:
    rows = [f"{name}: exit {r['exit_code']}, {r['steps_done']} steps in {r['job_wall_s']} s; {r['device']}: "
            f"{r['hbm_gbps']} GB/s HBM, {r['peak_bf16_tflops']} TFLOP/s bf16"]  # fmt: skip
    m = r["measured"]
    if m is None:
        return "\n".join([*rows, "  no step after the warm-up finished"])
    rows.append(f"  {'phase':8} {'s (median)':>11} {'floor s':>10} {'ratio':>8}")
    for ph in PHASES:
        ratio = m["phase_floor_ratio"][ph]
        rows.append(f"  {ph:8} {m['seconds_per_phase'][ph]:11.4f} {m['floor_s'][ph]:10.5f} "
                    f"{'-' if ratio is None else f'{ratio:.1f}':>8}")  # fmt: skip
    rows.append(
        f"  {'step':8} {m['step_s']:11.4f} {sum(m['floor_s'].values()):10.5f} {m['step_floor_ratio']:8.1f}"
    )
    for key, seconds in m.get("seconds_within_phases", {}).items():
        rows.append(f"    {key:40} {seconds:9.4f}")
    rows.append(f"  {m['response_tokens']} response + {m['prompt_tokens']} prompt tokens per step, "
                f"{m['response_tokens_per_s']} response tokens/s")  # fmt: skip
    for child, phases in sorted(r["peak_reserved_gib"].items()):
        cells = ", ".join(f"{ph} {v:.2f}" for ph, v in phases.items())
        rows.append(f"  peak reserved GiB {child}: {cells}")
    if r.get("plan"):
        rows.append(f"  memory plan {r['plan']['peak_gib']:.2f} GiB, measured peak "
                    f"{max(r['measured_gpu_gib_per_phase'].values(), default=0.0):.2f}: "
                    f"plan / measured {r['plan_over_measured']}")  # fmt: skip
    return "\n".join(rows)


def merged(out: Path, more: dict[str, dict]) -> dict[str, Any]:
    """The results of `out` (when present) with `more`'s records (by `result_key`) added or replaced."""
    result = json.loads(out.read_text()) if out.exists() else {}
    result |= {"benchmark": "gpu_step_roles", "config": str(CONFIG.relative_to(REPO)),
               "models": "random Qwen3 shapes (bf16, char tokenizer), student and teacher of one size",
               "floors": "benchmarks/step_floors.py"}  # fmt: skip
    result["shapes"] = {**result.get("shapes", {}), **more}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        shapes: dict[str, dict] = {}
        for path in args.merge:
            shapes |= json.loads(path.read_text()).get("shapes", {})
        return write_results(args.out, merged(args.out, shapes))
    import torch

    if torch.cuda.device_count() < 1:  # counts without a CUDA context: the job's children get the GPU alone
        print("gpu_step_roles: needs a CUDA GPU (the job runs on GPU 0)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device_info = None
    for shape in args.shapes:
        record, device_info = one_shape(shape, args, t0, device_info)
        key = result_key(shape, record["backends"])
        print(table(key, record), flush=True)
        write_results(args.out, merged(args.out, {key: record}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
