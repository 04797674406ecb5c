"""The MOPD controller (the actor group's rank 0): the step loop, checkpoints and resume, evaluation, the end.

Per step (DESIGN.md §3, `mopd.PhaseMachine`; c_d = 0 skips TEACHER and DRAIN; §7 for the group):

    ROLLOUT  draw data.batch_size prompts from the routed stream; the rollout engines sample
             samples_per_prompt responses each with behavior log-probs μ (in an SFT warm-up step, the
             route teachers answer greedily instead: `trainer/sft_warmup.py`); rewards by each source's scorer;
             A_ORM over the whole step (GRPO groups need every row); the step record goes to every rank
             of the actor group (`trainer/step_record.py`); a colocated sglang engine then releases its
             memory (kv_cache, weights, cuda_graph: `trainer/rollout_memory.py`)
    TEACHER  every rank (this one too) has the teachers score its own shard of the rows
             (`trainer/rank_step.py`): only the rows of routes that weight a teacher go to it; with a KL
             penalty (c_rl > 0, β > 0) every rank's reference model scores its shard too, even when c_d = 0
    DRAIN    every rank's drain receipt gathered here; then the teachers may be released: on GPU the ones
             the residency decision offloads (`offload_teachers`, `plan/residency_plan.py`) leave, the
             others stay resident; nothing to do on CPU
    TRAIN    one `train_step` of the engine on every rank's shard (the loss normalized over the whole step)
    SYNC     weights → rollout engines from this rank only: one copy per engine (`trainer/weight_sync.py`,
             weight_sync.backend: torch broadcast, gloo on CPU; or AWEX); weight_version = str(step); a
             released sglang engine resumes its weights before and its kv_cache and cuda_graph after

then an evaluation point every `data.eval.interval` steps (`trainer/evaluator.py`), one metrics line every
`log_interval` steps, at the last and at an evaluation step (`records/metrics.py`, `trainer/intervals.py`), a
Hugging Face export every `export.interval` steps (`trainer/exports.py`), and every `checkpoint_interval` steps
(and at the last) an atomic checkpoint under run_dir/checkpoints, written by this rank only: the DDP state is replicated (every rank
holds the same weights and optimizer state after each step), so one copy is every rank's; it records the
actor world size (model, optimizer, data-stream position, RNG, step, world size). An engine whose optimizer
state is DP-sharded (megatron's distributed optimizer, `collective_state_dict`) gathers it into rank 0's
state_dict: the checkpoint record brings the other ranks into that gather first (trainer/follower.py).

Resume: the newest checkpoint (if any) restores engine, stream and RNG; its step goes to every rank in the
start record and each loads the same checkpoint. At another world size the replicated state is valid as
it is ("resharded" trivially: nothing is sharded), and the stream position is this rank's (only it draws).
Metrics lines after its step are rolled back; the rollout engines get the restored weights before the first
rollout. SIGUSR2 (`CheckpointRequest`, this rank's only: the others ignore it) is honoured between steps:
checkpoint now, send the stop record, announce the end, return. At the end: the stop record, evaluation,
the student as an HF checkpoint in run_dir/student_final, and the end of the job announced to the servers (`records/job_end.py`).

Evaluation (`trainer/evaluator.py`, `trainer/evaluate.py`): the student generates on the rollout engines, the
teachers on their servers; the actor process loads no model for it. At the start it runs after the first
weight sync (the engines hold the weights of the start step: the initial ones, or the resumed checkpoint's),
every data.eval.interval steps after that step's sync, at the end after the last step's sync (the engines
hold the final weights, the ones saved in student_final); the engines' weight_version is checked against
that step and kept in eval.json.

Collaborators are given, not built here (`roles/actor.py` builds them): the engine (`engines.protocol.
TrainEngine`), the rollout and teacher clients (opened by the caller), the weight sync, the actor group.

Residency: the actor is made resident (`engine.onload()` when `engine.residency.on_device` is False) before
every train step, checkpoint and save: AWEX's colocate mode releases the actor's memory after each publish.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.protocol import TrainEngine
from mopd_hpc.engines.reference import ReferenceModel
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.teacher.replica_pool import TeacherPool
from mopd_hpc.mopd.phases import DrainReceipt, Phase, PhaseMachine, Transition
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.records.job_end import write_job_end
from mopd_hpc.records.metrics import MetricsWriter
from mopd_hpc.records.run_dir import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE
from mopd_hpc.runtime.signals import CheckpointRequest
from mopd_hpc.trainer.checkpoint import (
    capture_rng_state,
    load_latest,
    restore_rng_state,
    save_checkpoint,
    step_dir_name,
)
from mopd_hpc.trainer.data_setup import RunData
from mopd_hpc.trainer.evaluator import RunEvaluator, point_note
from mopd_hpc.trainer.exports import write_export
from mopd_hpc.trainer.group import ActorGroupError, SoloGroup
from mopd_hpc.trainer.intervals import checkpoint_due, eval_due, export_due, metrics_due
from mopd_hpc.trainer.phase_memory import PhaseMemory, server_peaks
from mopd_hpc.trainer.progress import Progress
from mopd_hpc.trainer.rank_step import Group, Receipts, ShardStep, make_resident
from mopd_hpc.trainer.rollout_memory import RolloutMemory
from mopd_hpc.trainer.rollout_phase import Rollouts, step_rollouts
from mopd_hpc.trainer.sft_warmup import is_sft_step, teacher_rollouts
from mopd_hpc.trainer.sharded_checkpoint import load_engine_shards, save_engine_shards
from mopd_hpc.trainer.step import orm_advantages, step_metrics
from mopd_hpc.trainer.step_record import ControlRecord
from mopd_hpc.trainer.weight_sync import WeightSync

log = logging.getLogger("mopd_hpc.trainer")

#: The consumer name of actor rank r's drain receipts.
ACTOR_CONSUMER = "actor-{rank}"
#: The checkpoint's `extra` key of the actor world size that saved it.
WORLD_SIZE_KEY = "actor_world_size"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a run ended on this rank: `reason` "finished" or "checkpoint_signal"; `step` = steps done."""

    reason: str
    step: int
    resumed_from: int


class Controller:
    """Runs the steps of one MOPD run as the actor group's rank 0 (module docstring).

    Args:
        cfg: the run config (absolute paths). plan: its ExecutionPlan.
        engine: the actor's train engine (`TrainEngine`: the loss bound, `residency`, `onload`).
            tokenizer: the shared tokenizer.
        data: the routed stream, its scorers and the held-out prompts.
        rollout: a client per rollout engine, in engine order. teachers: teacher id → client (every
            teacher the plan scores). Both opened (and closed) by the caller.
        sync: the weight sync to the rollout engines (`build_sync`).
        run_dir: the run directory. job_id: this job (recorded in checkpoints). out: progress output.
        group: the actor group (`ActorGroup` joined as rank 0, or `SoloGroup` for one rank).
        checkpoint_request: the installed SIGUSR2 handler (None: not honoured).
        reference: this rank's reference model (`engines/reference.py`), exactly when the plan has a KL
            penalty (`plan.requires_reference`): the starting weights, never restored from a checkpoint.
        offload_teachers: ids of the teachers offloaded at each drain on GPU (onloaded when scoring
            starts); None = every teacher. The others stay resident.
    """

    def __init__(
        self,
        cfg: RunConfig,
        plan: ExecutionPlan,
        engine: TrainEngine,
        tokenizer: Any,
        data: RunData,
        *,
        rollout: Sequence[RolloutClient],
        teachers: Mapping[str, TeacherPool],
        sync: WeightSync,
        run_dir: Path,
        job_id: str,
        out: TextIO,
        group: Group | None = None,
        checkpoint_request: CheckpointRequest | None = None,
        token: str | None = None,
        reference: ReferenceModel | None = None,
        offload_teachers: frozenset[str] | None = None,
    ) -> None:
        self.cfg, self.plan, self.engine, self.tokenizer, self.data = cfg, plan, engine, tokenizer, data
        self.rollout, self.teachers, self.sync = list(rollout), dict(teachers), sync
        self.run_dir, self.job_id, self.out = run_dir, job_id, out
        self.group: Group = group if group is not None else SoloGroup()
        if self.group.rank != 0:
            raise ActorGroupError(f"the controller runs on actor rank 0, not rank {self.group.rank}")
        self.checkpoint_request = checkpoint_request
        self._token = token
        self.routes = tuple(cfg.data.routes_used)
        self.route_weights = cfg.used_route_weights()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.gpu = any(g.gpus_per_node > 0 for g in cfg.cluster.groups().values())
        self.moving = moving_teachers(self.teachers, self.gpu, offload_teachers)
        #: The rollout engines' memory at the phase boundaries (active: colocated sglang).
        self.rollout_memory = RolloutMemory.from_config(cfg)
        self.shard_step = ShardStep(
            engine, self.teachers, plan, cfg.loss, self.route_weights, self.group, reference, steps=cfg.steps
        )
        #: Every phase change of the run, in order (for the event log and tests).
        self.transitions: list[Transition] = []
        consumers = tuple(ACTOR_CONSUMER.format(rank=r) for r in range(self.group.world_size))
        #: Peak GPU memory of this child per phase (inactive on CPU), fed by the phase machine's transitions.
        self.phase_memory = PhaseMemory.of_engine(engine)
        self.machine = PhaseMachine.from_plan(
            plan, consumers=consumers, on_transition=self.phase_memory.observer(self.transitions.append)
        )
        self.evaluator = RunEvaluator(cfg, data, tokenizer, self.rollout, self.teachers, run_dir, out)
        self.step = 0
        self._saved_step = -1

    # ------------------------------------------------------------------------------------- the run

    async def run(self) -> RunOutcome:
        """Resume or start, run the remaining steps, evaluate and save at the end (module docstring)."""
        start = self._resume()
        await self.group.publish(ControlRecord.start(start))
        if start > 0 and getattr(
            self.engine, "sharded_checkpoint", False
        ):  # with the followers: a collective
            load_engine_shards(self.engine, self.run_dir / CHECKPOINTS_DIR / step_dir_name(start))
        self.group.barrier(f"after every rank loaded the state of step {start}")
        metrics = MetricsWriter.open(self.run_dir / METRICS_FILE, resume_step=start)
        with contextlib.closing(metrics):
            await self.sync.start(self.rollout)
            await self._announce_gather(start, "sync")
            await self.sync.push(start, self.rollout)
            log.info("rollout engines hold the weights of step %d", start)
            if start == 0 or not self.evaluator.resume(start):
                await self.evaluator.start(start)
            with Progress(self.out, start, self.cfg.steps) as progress:
                for step in range(start + 1, self.cfg.steps + 1):
                    if self._stop_requested():
                        return await self._stop_for_signal(progress, start)
                    values = await self._one_step(step)
                    if eval_due(step, self.cfg) and self.evaluator.active:
                        point = await self.evaluator.point(step)  # the engines hold this step's weights
                        values |= point
                        progress.note(point_note(step, point))
                    if metrics_due(step, self.cfg):
                        metrics.write(step, values)
                    progress.update(step, values)
                    if export_due(step, self.cfg):
                        await self._export(step)
                    if checkpoint_due(step, self.cfg):
                        await self._checkpoint(step)
            if self._stop_requested():
                return await self._stop_for_signal(None, start)
            with contextlib.suppress(Exception):
                await self.sync.close(self.rollout)
        await self.evaluator.end(self.step)  # on the rollout engines, which hold the last step's weights
        await self._finish()  # before the stop record: a TP actor's export is a gather every TP rank joins
        await self._end_group("finished")
        write_job_end(self.run_dir, self.job_id, "finished", self.step)
        return RunOutcome("finished", self.step, start)

    async def _announce_gather(self, step: int, reason: str) -> None:
        """The `weights` record before each HF-weight gather of a TP engine (`engine.gathers_over_tp`) or an
        expert-parallel one (`gathers_over_ep`): the other ranks of rank 0's TP (EP) group join it; and before each sync that every rank writes
        (`sync.every_rank`: AWEX from a multi-rank actor), where each follower publishes its own shards
        (trainer/follower.py, trainer/rank_writer.py). Nothing for a one-rank sync at TP 1."""
        every_rank = reason == "sync" and getattr(self.sync, "every_rank", False)
        gathers = getattr(self.engine, "gathers_over_tp", False) or getattr(
            self.engine, "gathers_over_ep", False
        )
        if every_rank or gathers:
            await self.group.publish(ControlRecord.weights(step, reason))

    def _stop_requested(self) -> bool:
        return self.checkpoint_request is not None and self.checkpoint_request.requested

    async def _end_group(self, reason: str) -> None:
        """The stop record to every rank, and every rank through the last barrier."""
        await self.group.publish(ControlRecord.stop(self.step, reason))
        self.group.barrier(f"at the end of the run ({reason})")

    async def _stop_for_signal(self, progress: Progress | None, start: int) -> RunOutcome:
        if self._saved_step != self.step:
            await self._checkpoint(self.step)
        await self._end_group("checkpoint_signal")
        message = f"checkpoint signal: saved step {self.step}; exiting (re-run the same command to resume)"
        if progress is not None:
            progress.note(message)
        else:
            print(message, file=self.out, flush=True)
        write_job_end(self.run_dir, self.job_id, "checkpoint_signal", self.step)
        return RunOutcome("checkpoint_signal", self.step, start)

    # ----------------------------------------------------------------------------------- one step

    async def _one_step(self, step: int) -> dict[str, Any]:
        timings: dict[str, float] = {}
        self.phase_memory.start_step()
        try:
            t0 = time.perf_counter()
            n = self.cfg.data.samples_per_prompt
            rollouts = await self._rollouts(step)
            await self.rollout_memory.release(self.rollout)  # every row is back: the engines are idle
            record = ControlRecord.from_rows(
                step,
                rollouts.rows,
                rollouts.starts,
                rollouts.routes,
                rollouts.behavior_logprobs,
                orm_advantages(rollouts.rewards, self.plan, n),
                self.pad_id,
                rollouts.routed_experts,
            )
            timings["rollout"] = time.perf_counter() - t0
            if self.plan.scores_before_train:  # teachers, or the reference model (`engines/reference.py`)
                self.machine.transition(Phase.TEACHER)
                for client in self.moving.values():
                    await client.onload()
            else:
                self.machine.transition(Phase.TRAIN)
            await self.group.publish(record)
            outcome = await self.shard_step.run(
                record,
                on_drained=self._drained,
                before_train=lambda: make_resident(self.engine, "train step"),
            )
            self.machine.transition(Phase.SYNC)
            t0 = time.perf_counter()
            await self.rollout_memory.resume_weights(self.rollout)
            await self._announce_gather(step, "sync")
            await self.sync.push(step, self.rollout)
            await self.rollout_memory.resume_cache(self.rollout)
            timings["sync"] = time.perf_counter() - t0
            sync_spans = dict(getattr(self.sync, "spans", {}))
            self.machine.transition(Phase.ROLLOUT)
        except BaseException:
            with contextlib.suppress(Exception):
                self.machine.transition(Phase.ABORT)
            raise
        self.step = step
        values = step_metrics(
            outcome.stats, rollouts, timings | dict(outcome.timings), self.cfg.loss, self.routes
        )
        values["rollout/weight_version"] = _as_number(rollouts.weight_versions[0])
        values |= {f"time/sync/{span}_s": seconds for span, seconds in sync_spans.items()}
        values |= self.phase_memory.take()
        if self.phase_memory.active:
            values |= await server_peaks(self.teachers, self.rollout)
        return values

    async def _rollouts(self, step: int) -> Rollouts:
        """The step's rows: student samples on the rollout engines, or in an SFT warm-up step
        (`loss.sft_warmup_steps`) the route teachers' greedy answers on their servers (onloaded first)."""
        if not is_sft_step(step, self.cfg.loss, self.cfg.steps):
            return await step_rollouts(self.cfg, self.data, self.rollout, self.tokenizer, step, self.pad_id)
        for client in self.moving.values():
            await client.onload()
        generators = {tid: client.generate_greedy for tid, client in self.teachers.items()}
        return await teacher_rollouts(self.cfg, self.data, generators, self.tokenizer, self.pad_id)

    async def _drained(self, receipts: Receipts) -> None:
        """DRAIN: every rank's receipt recorded, then the teachers released (offloaded on GPU)."""
        self.machine.transition(Phase.DRAIN)
        for rank, step, rows in receipts:
            if step != self.step + 1:
                raise ActorGroupError(f"actor rank {rank} drained step {step} during step {self.step + 1}")
            self.machine.receive(DrainReceipt(ACTOR_CONSUMER.format(rank=rank), self.machine.step, rows))
        self.machine.release_teacher()
        for client in self.moving.values():
            await client.offload()
        self.machine.transition(Phase.TRAIN)

    # ------------------------------------------------------------------ resume, checkpoints, eval

    def _resume(self) -> int:
        ckpt = load_latest(self.run_dir / CHECKPOINTS_DIR)
        if ckpt is None:
            log.info("no checkpoint under %s: starting at step 0", self.run_dir / CHECKPOINTS_DIR)
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
        saved_world = ckpt.extra.get(WORLD_SIZE_KEY, 1)
        change = ""
        if saved_world != self.group.world_size:
            change = (
                f"; saved by an actor world of {saved_world} ranks, resumed on {self.group.world_size}: the "
                "replicated DDP state is every rank's as it is"
            )
        print(f"resuming from {ckpt.path} (step {ckpt.step}){change}", file=self.out, flush=True)
        return ckpt.step

    async def _checkpoint(self, step: int) -> None:
        make_resident(self.engine, "checkpoint")
        sharded = getattr(self.engine, "sharded_checkpoint", False)
        if sharded or getattr(self.engine, "collective_state_dict", False):  # the other ranks join
            await self.group.publish(ControlRecord.checkpoint(step))
        if sharded:  # every TP rank's shards first (a collective)
            save_engine_shards(self.engine, self.run_dir / CHECKPOINTS_DIR / step_dir_name(step))
        path = save_checkpoint(
            self.run_dir / CHECKPOINTS_DIR,
            step,
            self.engine.state_dict(),
            data_state=self.data.dataset.state_dict(),
            rng_state=capture_rng_state(),
            extra={
                "job_id": self.job_id,
                "config_name": self.cfg.name,
                WORLD_SIZE_KEY: self.group.world_size,
            },
        )
        self._saved_step = step
        log.info("checkpoint %s", path)

    async def _export(self, step: int) -> None:
        """The weights of `step` as a Hugging Face directory under run_dir/exports (`trainer/exports.py`)."""
        make_resident(self.engine, "export")
        await self._announce_gather(step, "export")
        path = write_export(self.engine, self.tokenizer, self.run_dir, step, self.cfg.export.keep)
        log.info("export %s", path)

    async def _finish(self) -> None:
        make_resident(self.engine, "save")
        await self._announce_gather(self.step, "export")
        self.engine.save_pretrained(self.run_dir / FINAL_DIR)
        print(
            f"done: {self.step} steps; student saved to {self.run_dir / FINAL_DIR}", file=self.out, flush=True
        )


def moving_teachers(
    teachers: Mapping[str, TeacherPool], gpu: bool, offload: frozenset[str] | None
) -> dict[str, TeacherPool]:
    """The teachers onloaded for scoring and offloaded at the drain: on a GPU those in `offload` (None: all);
    none on CPU."""
    if not gpu:
        return {}
    return {t: c for t, c in teachers.items() if offload is None or t in offload}


def _as_number(version: str) -> float:
    try:
        return float(version)
    except ValueError:
        return float("nan")
