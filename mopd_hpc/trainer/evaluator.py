"""The run's held-out evaluation points (the controller's, `trainer/controller.py`): at the start, every
`data.eval.interval` steps, and at the end; each on the rollout engines after the weight sync of its step.

    evaluator = RunEvaluator(cfg, data, tokenizer, rollout, teachers, run_dir, out)
    await evaluator.start(step)          # the teachers once, the student's first point; the start table
    values = await evaluator.point(step) # a point at an interval step: its metrics keys (below)
    await evaluator.end(step)            # the last point (the interval's, when it was taken at `step`)

A point is the student's greedy pass@1 per route and, with data.eval.samples = k > 0, its sampled mean@k
(`trainer/evaluate.py` for both definitions). Each point is appended to eval.json's `points` (written
atomically; a resumed run drops the points after its checkpoint's step first, as the metrics are rolled back)
and, at an interval step, to that step's metrics line as

    eval/pass@1/<route>, eval/mean@k/<route>     fractions in [0, 1] (records/metrics_schema.py)

The start point's pass@1 is eval.json's `student_start`, the end point's `student_end` (the table `make run`
prints). Prompts are scored by their source's reward (`RunData.score`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.teacher.replica_pool import TeacherPool
from mopd_hpc.records.eval_table import format_eval_table, read_eval
from mopd_hpc.records.metrics_schema import eval_key
from mopd_hpc.trainer import evaluate
from mopd_hpc.trainer.data_setup import RunData

log = logging.getLogger("mopd_hpc.trainer")

#: eval.json keys of the points and of k.
POINTS_KEY = "points"
K_KEY = "k"


class RunEvaluator:
    """The evaluation points of one run (module docstring).

    Args:
        cfg: the run config. data: its held-out prompts and scorers. tokenizer: the shared tokenizer.
        rollout: a client per rollout engine. teachers: teacher id → client (the start's teacher accuracy).
        run_dir: where eval.json is. out: the run's output (tables, remarks).
    """

    def __init__(
        self,
        cfg: RunConfig,
        data: RunData,
        tokenizer: Any,
        rollout: Sequence[RolloutClient],
        teachers: Mapping[str, TeacherPool],
        run_dir: Path,
        out: TextIO,
    ) -> None:
        self.cfg, self.data, self.tokenizer = cfg, data, tokenizer
        self.rollout, self.teachers, self.run_dir, self.out = list(rollout), dict(teachers), run_dir, out
        self.route_weights = cfg.used_route_weights()
        self.prompts = data.eval_prompts
        self.counts = {r: len(p) for r, p in self.prompts.items()}

    @property
    def active(self) -> bool:
        """Whether there is anything to evaluate (data.eval.size > 0 and some source has a held-out split)."""
        return bool(self.prompts)

    async def start(self, step: int) -> None:
        """The teachers on their servers, the student's point at `step` (the engines hold its weights); a new
        eval.json, the start table printed."""
        if not self.active:
            return
        max_new = self.cfg.rollout.sampling.max_new_tokens
        generators = {tid: client.generate_greedy for tid, client in self.teachers.items()}
        teachers = await evaluate.teacher_accuracy(
            generators, self.route_weights, self.tokenizer, self.prompts, max_new, self.data.score
        )
        point = await self._student_point(step)
        record = evaluate.eval_record(
            teachers, point["pass@1"], None, self.counts, {"start": point["weight_version"]}
        )
        self._write(record | {K_KEY: self.cfg.data.eval.samples, POINTS_KEY: [point]})
        print("evaluation at the start:\n" + format_eval_table(record), file=self.out, flush=True)

    def resume(self, step: int) -> bool:
        """A resumed run at `step`: drop eval.json's points after it. Returns whether eval.json exists (False:
        the start evaluation is still to do)."""
        return keep_points_upto(self.run_dir, step)

    async def point(self, step: int) -> dict[str, float]:
        """The student's point at `step` into eval.json; returns its metrics values (module docstring)."""
        if not self.active:
            return {}
        point = await self._student_point(step)
        record = read_eval(self.run_dir) or {"routes": {}, "teachers": {}}
        points = [p for p in record.get(POINTS_KEY, []) if p.get("step") != step]
        self._write(record | {K_KEY: self.cfg.data.eval.samples, POINTS_KEY: [*points, point]})
        return point_metrics(point)

    async def end(self, step: int) -> None:
        """The end point (the last point when it was taken at `step`, else a new one): `student_end` and the
        end table."""
        if not self.active:
            return
        record = read_eval(self.run_dir) or {"routes": {}, "teachers": {}}
        last = (record.get(POINTS_KEY) or [{}])[-1]
        if last.get("step") != step:
            await self.point(step)
            record = read_eval(self.run_dir) or record
            last = record[POINTS_KEY][-1]
        start = {r: v.get("student_start") for r, v in record["routes"].items()}
        weights = {"start": (record.get("student_weights") or {}).get("start"), "end": last["weight_version"]}
        table = evaluate.eval_record(record.get("teachers", {}), start, last["pass@1"], self.counts, weights)
        self._write(record | table)
        print("evaluation at the end:\n" + format_eval_table(table), file=self.out, flush=True)

    async def _student_point(self, step: int) -> dict[str, Any]:
        """{"step", "weight_version", "pass@1", "mean@k"} of the weights the engines hold (those of `step`); a
        weight_version other than str(step) is said on the run's output."""
        sampling, k = self.cfg.rollout.sampling, self.cfg.data.eval.samples
        greedy = await evaluate.student_accuracy_on_engines(
            self.rollout, self.tokenizer, self.prompts, sampling.max_new_tokens, self.data.score
        )
        versions = set(greedy.weight_versions)
        mean_k: dict[str, float] = {}
        if k > 0:
            sampled = await evaluate.student_mean_at_k(
                self.rollout,
                self.tokenizer,
                self.prompts,
                sampling,
                k,
                self.cfg.data.eval.seed,
                self.data.score,
            )
            mean_k = sampled.accuracy
            versions.update(sampled.weight_versions)
        version = ",".join(sorted(versions)) if versions else None
        if versions and versions != {str(step)}:
            message = (
                f"evaluation: the rollout engines answered with weight_version {version!r}, "
                f"expected {str(step)!r} (the weights of step {step}, synced before the evaluation)"
            )
            log.warning("%s", message)
            print(message, file=self.out, flush=True)
        return {"step": step, "weight_version": version, "pass@1": greedy.accuracy, "mean@k": mean_k}

    def _write(self, record: Mapping[str, Any]) -> None:
        evaluate.write_eval(self.run_dir, record)


def keep_points_upto(run_dir: Path, step: int) -> bool:
    """Drop eval.json's points after `step` (rewritten atomically, only when some are dropped); returns whether
    eval.json exists."""
    record = read_eval(run_dir)
    if record is None:
        return False
    points = [p for p in record.get(POINTS_KEY, []) if p.get("step", 0) <= step]
    if points != record.get(POINTS_KEY, []):
        evaluate.write_eval(run_dir, record | {POINTS_KEY: points})
    return True


def point_metrics(point: Mapping[str, Any]) -> dict[str, float]:
    """A point's metrics values: `eval/pass@1/<route>` and, when sampled, `eval/mean@k/<route>`."""
    out = {eval_key("pass@1", route): float(v) for route, v in point["pass@1"].items()}
    out |= {eval_key("mean@k", route): float(v) for route, v in (point.get("mean@k") or {}).items()}
    return out


def point_note(step: int, values: Mapping[str, float]) -> str:
    """One line for the progress output: `eval at step 20: pass@1/chain 55.0%, mean@k/chain 41.2%`."""
    parts = [f"{key.removeprefix('eval/')} {100 * v:.1f}%" for key, v in values.items()]
    return f"eval at step {step}: " + ", ".join(parts)
