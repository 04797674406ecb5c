"""A rank > 0 of the actor group: the same step as rank 0 (SPMD), without the step's I/O.

    start record   load the checkpoint rank 0 resumes from (the same directory: step_<N>, not `latest`,
                   which rank 0 may rewrite later; a TP engine's own shards from step_<N>.shards, with
                   its TP group; not its own files, which rank 0 verified and reads), restore its RNG;
                   barrier
    step record    `ShardStep.run` on this rank's shard: its own rows' teacher scores straight from the
                   teacher servers (at TP > 1 TP rank 0's, broadcast over its TP group: only TP rank 0
                   asks), the drain gather, `train_step` (the gradient all-reduce)
    weights record reason "sync" with a writer (AWEX: trainer/rank_writer.py): this rank publishes its own
                   shards, as rank 0 does at the same time; otherwise a TP rank of data-parallel rank 0's
                   TP group (at expert_parallel > 1: a rank of rank 0's EP group) joins rank 0's gather of the HF weights (weight sync, evaluation, export:
                   `engine.join_weight_gather`), and other ranks ignore it
    checkpoint     a TP engine's rank writes its shards of the step (trainer/sharded_checkpoint.py); an engine
                   whose state_dict is a collective (`collective_state_dict`: megatron's distributed
                   optimizer at DP > 1 gathers its parameter state) joins rank 0's (`join_state_dict`)
    stop record    the last barrier; return

Rank 0 decides everything else: when to checkpoint (a follower ignores SIGUSR2; the actor role sets it so),
when the run ends, the metrics and the checkpoints (the DDP state is replicated: rank 0's copy is every
rank's). A follower waits for each record as long as rank 0 is alive (trainer/actor_group.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mopd_hpc.engines.protocol import TrainEngine
from mopd_hpc.records.run_dir import CHECKPOINTS_DIR
from mopd_hpc.trainer.checkpoint import load_checkpoint, restore_rng_state, step_dir_name
from mopd_hpc.trainer.controller import RunOutcome
from mopd_hpc.trainer.group import ActorGroupError, Group
from mopd_hpc.trainer.rank_step import ShardStep, make_resident
from mopd_hpc.trainer.rank_writer import RankWriter
from mopd_hpc.trainer.sharded_checkpoint import load_engine_shards, save_engine_shards

log = logging.getLogger("mopd_hpc.trainer")


class Follower:
    """Runs a rank > 0 of the actor group (module docstring).

    Args:
        engine: this rank's train engine (the same checkpoint and config as rank 0's).
        shard_step: its `ShardStep` (teacher clients opened by the caller).
        group: the actor group, joined as this rank.
        run_dir: the run directory (checkpoints under run_dir/checkpoints).
        writer: this rank's own weight-sync writer (`build_rank_writer`: AWEX), or None (rank 0 sends).
    """

    def __init__(
        self,
        engine: TrainEngine,
        shard_step: ShardStep,
        group: Group,
        run_dir: Path,
        writer: RankWriter | None = None,
    ) -> None:
        if group.rank == 0:
            raise ActorGroupError("actor rank 0 runs the controller, not a follower")
        self.engine, self.shard_step, self.group, self.run_dir = engine, shard_step, group, Path(run_dir)
        self.writer = writer
        #: Steps this rank trained, in order (for tests).
        self.steps: list[int] = []

    async def run(self) -> RunOutcome:
        """Follow rank 0 until its stop record. Raises PeerLostError when rank 0 or a peer is gone."""
        start = await self.group.receive()
        if start.kind != "start":
            raise ActorGroupError(f"actor rank {self.group.rank}: first control record is {start.kind!r}")
        if start.step > 0:
            path = self.run_dir / CHECKPOINTS_DIR / step_dir_name(start.step)
            # its own files (the optimizer parameter state, which DP rank 0 alone reads: rank 0 here) are
            # not opened: rank 0's load_latest verified them before naming this checkpoint
            ckpt = load_checkpoint(path, verify_own_files=False)
            make_resident(self.engine, "checkpoint load")
            self.engine.load_state_dict(ckpt.engine_state)
            if getattr(self.engine, "sharded_checkpoint", False):
                load_engine_shards(self.engine, path)
            restore_rng_state(ckpt.rng_state)
            log.info("actor rank %d resumed from %s", self.group.rank, path)
        self.group.barrier(f"after every rank loaded the state of step {start.step}")
        while True:
            record = await self.group.receive()
            if record.kind == "stop":
                self.group.barrier(f"at the end of the run ({record.reason})")
                log.info("actor rank %d: %s at step %d", self.group.rank, record.reason, record.step)
                return RunOutcome(record.reason, record.step, start.step)
            if record.kind == "weights":
                if record.reason == "sync" and self.writer is not None:
                    self.writer.publish(record.step)  # its own shards, with rank 0's publish
                elif (getattr(self.engine, "gathers_over_tp", False) and self.group.dp_rank == 0) or getattr(
                    self.engine, "in_rank0_expert_group", False
                ):  # rank 0's TP group, or its EP group (expert_parallel > 1)
                    make_resident(self.engine, f"weight gather ({record.reason})")
                    self.engine.join_weight_gather()
                continue
            if record.kind == "checkpoint":
                make_resident(self.engine, "checkpoint")
                save_engine_shards(self.engine, self.run_dir / CHECKPOINTS_DIR / step_dir_name(record.step))
                if getattr(self.engine, "collective_state_dict", False):  # its shard of rank 0's state_dict
                    self.engine.join_state_dict()
                continue
            if record.kind != "step":
                raise ActorGroupError(f"actor rank {self.group.rank}: unexpected {record.kind!r} record")
            await self.shard_step.run(record, before_train=lambda: make_resident(self.engine, "train step"))
            self.steps.append(record.step)
