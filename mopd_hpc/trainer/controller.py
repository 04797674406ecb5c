"""The MOPD controller (the actor's rank 0): the step loop, checkpoints and resume, evaluation, the end.

Per step (DESIGN.md §3, `mopd.PhaseMachine`; c_d = 0 skips TEACHER and DRAIN):

    ROLLOUT  draw data.batch_size prompts from the routed stream; the rollout engines sample
             samples_per_prompt responses each with behavior log-probs μ; rewards by each source's scorer
    TEACHER  each teacher scores only the rows of routes that weight it (sampled tokens; top-k for topk)
    DRAIN    the actor builds its TrainBatch from the answers and drops them (drain receipt), then the
             teachers may be released (offloaded on GPU; nothing to do on CPU)
    TRAIN    one `train_step` of the actor's engine (torch or megatron) with the loss bound at construction
    SYNC     weights actor → rollout engines (`trainer/weight_sync.py`, weight_sync.backend: torch broadcast,
             gloo on CPU; or AWEX); the rollout engines' weight_version = str(step)

then one metrics line (`records/metrics.py`), and every `checkpoint_interval` steps (and at the last) an atomic
checkpoint under run_dir/checkpoints (model, optimizer, data-stream position, RNG, step).

Resume: the newest checkpoint (if any) restores engine, stream and RNG; metrics lines after its step are
rolled back; the rollout engines get the restored weights before the first rollout. SIGUSR2
(`CheckpointRequest`) is honoured between steps: checkpoint now, announce the end, return. At the end:
evaluation, the student as an HF checkpoint in run_dir/student_final, and the end of the job announced to
the servers (`records/job_end.py`).

Residency: the actor is made resident (`engine.onload()` when `engine.residency.on_device` is False) before
every train step, checkpoint, evaluation and save: AWEX's colocate mode releases the actor's memory after
each publish. Evaluation generates with `engine.evaluation_model()` (the torch engine's own model; for
megatron a transformers copy built for the call and dropped after it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.teacher_server import TeacherClient
from mopd_hpc.mopd.phases import DrainReceipt, Phase, PhaseMachine, Transition
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.records.job_end import write_job_end
from mopd_hpc.records.metrics import MetricsWriter
from mopd_hpc.records.run_dir import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE
from mopd_hpc.runtime.signals import CheckpointRequest
from mopd_hpc.trainer import evaluate
from mopd_hpc.trainer.checkpoint import capture_rng_state, load_latest, restore_rng_state, save_checkpoint
from mopd_hpc.trainer.data_setup import RunData
from mopd_hpc.trainer.phase_memory import PhaseMemory
from mopd_hpc.trainer.progress import Progress
from mopd_hpc.trainer.rollout_phase import Rollouts, collect_rollouts
from mopd_hpc.trainer.step import ratio_stats, step_metrics, train_batch
from mopd_hpc.trainer.teacher_phase import TeacherScores, score_teachers
from mopd_hpc.trainer.weight_sync import SyncSettings, WeightSync, build_sync

log = logging.getLogger("mopd_hpc.trainer")

#: Checkpoints live here, under the run directory.
CHECKPOINT_DIR = CHECKPOINTS_DIR
#: The student as an HF checkpoint at the end of the run.
#: The consumer name of the actor's drain receipts.
ACTOR_CONSUMER = "actor"


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the servers of the job listen: rollout engine URLs (by index) and teacher URLs (by id)."""

    rollout: tuple[str, ...]
    teachers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How `Controller.run` ended: `reason` "finished" or "checkpoint_signal"; `step` = steps done."""

    reason: str
    step: int
    resumed_from: int


class Controller:
    """Runs the steps of one MOPD run (module docstring). Collaborators are built by `roles/actor.py`.

    Args:
        cfg: the run config (absolute paths). plan: its ExecutionPlan.
        engine: the actor's train engine, `TorchTrainEngine` or `MegatronTrainEngine` (the loss section
            bound; `residency`, `onload`, `evaluation_model`). tokenizer: the shared tokenizer.
        data: the routed stream, its scorers and the held-out prompts.
        endpoints: the servers. sync: the weight-sync rendezvous.
        run_dir: the run directory. job_id: this job (for the end-of-job marker).
        out: progress output. checkpoint_request: the installed SIGUSR2 handler (None: not honoured).
        token: the job's token, sent by the teacher and rollout clients (None: the servers take none).
    """

    def __init__(
        self,
        cfg: RunConfig,
        plan: ExecutionPlan,
        engine: Any,
        tokenizer: Any,
        data: RunData,
        endpoints: Endpoints,
        sync: SyncSettings,
        run_dir: Path,
        job_id: str,
        out: TextIO,
        checkpoint_request: CheckpointRequest | None = None,
        token: str | None = None,
    ) -> None:
        self.cfg, self.plan, self.engine, self.tokenizer, self.data = cfg, plan, engine, tokenizer, data
        self.endpoints, self.sync, self.run_dir, self.job_id, self.out = endpoints, sync, run_dir, job_id, out
        self.checkpoint_request = checkpoint_request
        self._token = token
        self.routes = tuple(cfg.data.routes_used)
        self.route_weights = {r: dict(cfg.routes[r]) for r in self.routes}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.gpu = any(g.gpus_per_node > 0 for g in cfg.cluster.groups().values())
        #: Every phase change of the run, in order (for the event log and tests).
        self.transitions: list[Transition] = []
        #: Peak GPU memory of this child per phase (inactive on CPU), fed by the phase machine's transitions.
        self.phase_memory = PhaseMemory.of_engine(engine)
        self.machine = PhaseMachine.from_plan(
            plan,
            consumers=(ACTOR_CONSUMER,),
            on_transition=self.phase_memory.observer(self.transitions.append),
        )
        self.step = 0
        self._saved_step = -1

    # ------------------------------------------------------------------------------------- the run

    async def run(self) -> RunOutcome:
        """Resume or start, run the remaining steps, evaluate and save at the end (module docstring)."""
        start = self._resume()
        metrics = MetricsWriter.open(self.run_dir / METRICS_FILE, resume_step=start)
        rollout = [RolloutClient(url, token=self._token, timeout_s=600.0) for url in self.endpoints.rollout]
        teachers = {
            t: TeacherClient(self.endpoints.teachers[t], token=self._token) for t in self.plan.teachers
        }
        sync = build_sync(self.cfg, self.engine, self.sync, self.run_dir)
        async with contextlib.AsyncExitStack() as stack:
            for client in [*rollout, *teachers.values()]:
                await stack.enter_async_context(client)
            stack.push_async_callback(metrics_close, metrics)
            if start == 0 or evaluate.read_eval(self.run_dir) is None:
                self._evaluate_start()
            await sync.start(rollout)
            await sync.push(start, rollout)
            log.info("rollout engines hold the weights of step %d", start)
            with Progress(self.out, start, self.cfg.steps) as progress:
                for step in range(start + 1, self.cfg.steps + 1):
                    if self.checkpoint_request is not None and self.checkpoint_request.requested:
                        return self._stop_for_signal(progress, start)
                    values = await self._one_step(step, rollout, teachers, sync)
                    metrics.write(step, values)
                    progress.update(step, values)
                    if step % self.cfg.checkpoint_interval == 0 or step == self.cfg.steps:
                        self._checkpoint(step)
            if self.checkpoint_request is not None and self.checkpoint_request.requested:
                return self._stop_for_signal(None, start)
            with contextlib.suppress(Exception):
                await sync.close(rollout)
        self._finish()
        return RunOutcome("finished", self.step, start)

    def _stop_for_signal(self, progress: Progress | None, start: int) -> RunOutcome:
        if self._saved_step != self.step:
            self._checkpoint(self.step)
        message = f"checkpoint signal: saved step {self.step}; exiting (re-run the same command to resume)"
        if progress is not None:
            progress.note(message)
        else:
            print(message, file=self.out, flush=True)
        write_job_end(self.run_dir, self.job_id, "checkpoint_signal", self.step)
        return RunOutcome("checkpoint_signal", self.step, start)

    # ----------------------------------------------------------------------------------- one step

    async def _one_step(
        self,
        step: int,
        rollout: list[RolloutClient],
        teachers: Mapping[str, TeacherClient],
        sync: WeightSync,
    ) -> dict[str, Any]:
        timings: dict[str, float] = {}
        self.phase_memory.start_step()
        try:
            t0 = time.perf_counter()
            draws = self.data.dataset.take(self.cfg.data.batch_size)
            rollouts = await collect_rollouts(
                rollout,
                draws,
                tokenizer=self.tokenizer,
                sources=self.data.sources,
                sampling=self.cfg.rollout.sampling,
                samples_per_prompt=self.cfg.data.samples_per_prompt,
                max_prompt_tokens=self.cfg.data.max_prompt_tokens,
                seed=self.cfg.seed,
                step=step,
                pad_id=self.pad_id,
            )
            timings["rollout"] = time.perf_counter() - t0
            scores = await self._teacher_phases(rollouts, teachers, timings)
            t0 = time.perf_counter()
            batch = train_batch(rollouts, scores, self.plan, self.cfg.data.samples_per_prompt)
            observe = None
            if self.plan.estimator == "topk" and self.plan.requires_teacher_scoring:
                # ρ statistics from the train step's own log π_θ (no second forward pass)
                observe = functools.partial(ratio_stats, batch=batch, loss=self.cfg.loss)
            self._resident("train step")
            stats = self.engine.train_step(batch, observe=observe)
            timings["train"] = time.perf_counter() - t0
            self.machine.transition(Phase.SYNC)
            t0 = time.perf_counter()
            await sync.push(step, rollout)
            timings["sync"] = time.perf_counter() - t0
            self.machine.transition(Phase.ROLLOUT)
        except BaseException:
            with contextlib.suppress(Exception):
                self.machine.transition(Phase.ABORT)
            raise
        self.step = step
        values = step_metrics(stats, rollouts, timings, self.cfg.loss, self.routes)
        values["rollout/weight_version"] = _as_number(rollouts.weight_versions[0])
        values |= self.phase_memory.take()
        return values

    async def _teacher_phases(
        self, rollouts: Rollouts, teachers: Mapping[str, TeacherClient], timings: dict[str, float]
    ) -> TeacherScores | None:
        """TEACHER and DRAIN (or straight to TRAIN when the plan scores no teacher)."""
        if not self.plan.requires_teacher_scoring:
            self.machine.transition(Phase.TRAIN)
            return None
        self.machine.transition(Phase.TEACHER)
        t0 = time.perf_counter()
        if self.gpu:
            for client in teachers.values():
                await client.onload()
        scores = await score_teachers(
            teachers,
            rollouts.rows,
            rollouts.starts,
            rollouts.tokens,
            rollouts.routes,
            self.route_weights,
            top_k=self.cfg.loss.topk if self.plan.estimator == "topk" else None,
        )
        timings["teacher"] = time.perf_counter() - t0
        self.machine.transition(Phase.DRAIN)
        t0 = time.perf_counter()
        # The answers now live only in `scores` (tensors the actor owns): nothing of the teachers is held.
        self.machine.receive(DrainReceipt(ACTOR_CONSUMER, self.machine.step, len(scores.rows_scored)))
        self.machine.release_teacher()
        if self.gpu:
            for client in teachers.values():
                await client.offload()
        timings["drain"] = time.perf_counter() - t0
        self.machine.transition(Phase.TRAIN)
        return scores

    # ------------------------------------------------------------------ resume, checkpoints, eval

    def _resume(self) -> int:
        ckpt = load_latest(self.run_dir / CHECKPOINT_DIR)
        if ckpt is None:
            log.info("no checkpoint under %s: starting at step 0", self.run_dir / CHECKPOINT_DIR)
            return 0
        for line in ckpt.skipped:  # a damaged newer checkpoint: said where the user reads, then passed over
            print(f"checkpoint skipped: {line}", file=self.out, flush=True)
        self.engine.load_state_dict(ckpt.engine_state)
        self.data.dataset.load_state_dict(ckpt.data_state)
        restore_rng_state(ckpt.rng_state)
        self.step = self._saved_step = ckpt.step
        log.info(
            "resumed from %s (step %d, stream position %d)", ckpt.path, ckpt.step, self.data.dataset.position
        )
        print(f"resuming from {ckpt.path} (step {ckpt.step})", file=self.out, flush=True)
        return ckpt.step

    def _resident(self, what: str) -> None:
        """Onload the actor when any of it is offloaded (AWEX colocate releases it after each publish)."""
        if not self.engine.residency.on_device:
            report = self.engine.onload()
            log.info("actor onloaded before the %s: %s", what, report.message)

    def _student_accuracy(self, prompts: Mapping[str, Any]) -> dict[str, float]:
        """route → greedy accuracy of the actor's current weights (`engine.evaluation_model()`, dropped after)."""
        self._resident("evaluation")
        model = self.engine.evaluation_model()
        try:
            return evaluate.student_accuracy(model, self.tokenizer, prompts, self._max_new_tokens())
        finally:
            del model
            _empty_cuda_cache()

    def _checkpoint(self, step: int) -> None:
        self._resident("checkpoint")
        path = save_checkpoint(
            self.run_dir / CHECKPOINT_DIR,
            step,
            self.engine.state_dict(),
            data_state=self.data.dataset.state_dict(),
            rng_state=capture_rng_state(),
            extra={"job_id": self.job_id, "config_name": self.cfg.name},
        )
        self._saved_step = step
        log.info("checkpoint %s", path)

    def _max_new_tokens(self) -> int:
        return self.cfg.rollout.sampling.max_new_tokens

    def _evaluate_start(self) -> None:
        prompts = self.data.eval_prompts
        if not prompts:
            return
        paths = {t.id: t.path for t in self.cfg.models.teachers}
        teachers = evaluate.teacher_accuracy(
            paths, self.route_weights, self.tokenizer, prompts, self._max_new_tokens()
        )
        start = self._student_accuracy(prompts)
        counts = {r: len(p) for r, p in prompts.items()}
        record = evaluate.eval_record(teachers, start, None, counts)
        evaluate.write_eval(self.run_dir, record)
        print("evaluation at the start:\n" + evaluate.format_eval_table(record), file=self.out, flush=True)

    def _finish(self) -> None:
        prompts = self.data.eval_prompts
        if prompts:
            record = evaluate.read_eval(self.run_dir) or {"routes": {}, "teachers": {}}
            end = self._student_accuracy(prompts)
            start = {r: v.get("student_start") for r, v in record["routes"].items()}
            counts = {r: len(p) for r, p in prompts.items()}
            record = evaluate.eval_record(record.get("teachers", {}), start, end, counts)
            evaluate.write_eval(self.run_dir, record)
            print("evaluation at the end:\n" + evaluate.format_eval_table(record), file=self.out, flush=True)
        self._resident("save")
        self.engine.save_pretrained(self.run_dir / FINAL_DIR)
        write_job_end(self.run_dir, self.job_id, "finished", self.step)
        print(
            f"done: {self.step} steps; student saved to {self.run_dir / FINAL_DIR}", file=self.out, flush=True
        )


def _empty_cuda_cache() -> None:
    """Give the cached blocks of a dropped evaluation model back to the device (no-op without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


async def metrics_close(writer: MetricsWriter) -> None:
    writer.close()


def _as_number(version: str) -> float:
    try:
        return float(version)
    except ValueError:
        return float("nan")
