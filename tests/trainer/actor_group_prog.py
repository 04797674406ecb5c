"""One rank of the actor-group protocol tests (`python tests/trainer/actor_group_prog.py ...`); it holds no tests.

Every rank joins a real `ActorGroup` (gloo, real TCP store) and runs the real step protocol: rank 0 publishes
the start record and three step records (and the stop record) and runs its `ShardStep`; the other ranks run
`Follower`. The engine is a fake with one float64 parameter vector and a real gradient all-reduce (the
normalizer is the step's global token count, as the torch engine's), and the teachers are fake clients
that record the rows they are asked for. `run_rank(..., world=1)` runs the same steps on a `SoloGroup` in the
calling process: the DP = 1 reference.

Scenarios (argv[1]): `steps` (3 steps, the end), `busy` (rank 0 sleeps `--busy-s` between the start and the
first step: longer than the collective timeout), `rank1_dies` (rank 1 SIGKILLs itself after receiving
step 2's record), `rank1_hangs` (rank 1 sleeps for an hour instead of step 2), `rank0_dies` (rank 0 exits
after the start barrier), `rank0_freezes` (rank 0 SIGSTOPs itself there: its heartbeat stops too), `tp2` (the
two ranks are one TP group of DP size 1: both train every row, rank 0 alone asks the teacher and broadcasts
the scores to rank 1; after each step rank 0 announces a weight
gather with a `weights` record and gathers the fake engine's two halves over gloo, which the follower
joins; rank 0 also sums 1.0 over the group's data-parallel ranks), `dp_checkpoint` (DP 2 with an engine
whose state_dict is a collective, as megatron's distributed optimizer gathering its shards: after step 2
rank 0 publishes a `checkpoint` record and calls state_dict, which the follower joins), `tp2dp2` (world 4:
two replicas of a TP group of 2; each replica's TP rank 0 asks the teacher for its shard and broadcasts the
scores to its TP rank 1; the engine reduces over the DP groups {0, 2}, {1, 3}), `writers` (tp2dp2's world
with a sync that every rank writes, as AWEX from a DP × TP actor: after each step rank 0 sends a `weights`
record and publishes, and every follower's writer publishes its own piece at the same time: a stand-in for
awex's writer whose publish all-gathers (rank, step, its TP piece of the parameter) over the world), `tp2_nccl` (tp2's steps on two GPUs: the world and
the TP group on NCCL, the scores broadcast through the devices; no weight gather). Each rank writes
`<out>/rank<r>.json`: what it trained (and a bitwise digest of each batch), asked the teachers (the rows, and
the rows of each request), gathered, its final parameter, or its error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.memory.residency import Residency
from mopd_hpc.engines.teacher.score_frames import ScoreTensors
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.trainer.actor_group import ActorGroup, GroupSpec
from mopd_hpc.trainer.follower import Follower
from mopd_hpc.trainer.group import SoloGroup
from mopd_hpc.trainer.rank_step import ShardStep
from mopd_hpc.trainer.shards import shard_rows
from mopd_hpc.trainer.step import shard_batch
from mopd_hpc.trainer.step_record import ControlRecord

STEPS = 3
LR = 0.5
LOSS = LossConfig(estimator="topk", topk=2)
PLAN = ExecutionPlan.from_config(LOSS, teachers=("t",))
ROUTE_WEIGHTS = {"a": {"t": 1.0}, "b": {"t": 0.5}}


def step_record(step: int) -> ControlRecord:
    """Step `step`'s rows: 5 rows of random length (an odd count: the split is uneven)."""
    gen = torch.Generator().manual_seed(100 + step)
    rows, starts = [], []
    for _ in range(5):
        prompt = int(torch.randint(1, 4, (1,), generator=gen))
        response = int(torch.randint(1, 7, (1,), generator=gen))
        rows.append(torch.randint(0, 30, (prompt + response,), generator=gen).tolist())
        starts.append(prompt)
    width = max(len(r) - s for r, s in zip(rows, starts, strict=True))
    mu = -torch.rand((5, width), generator=gen)
    orm = torch.randn(5, generator=gen)
    return ControlRecord.from_rows(step, rows, starts, ["a", "b", "a", "b", "a"], mu, orm, pad_id=0)


def digest(value) -> object:
    """A JSON-able fingerprint of a batch, bit for bit: each tensor's dtype, shape and SHA-256 of its bytes;
    dataclasses and mappings field by field, in order (mapping order included)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().numpy().tobytes()
        return [str(value.dtype), list(value.shape), hashlib.sha256(data).hexdigest()]
    if dataclasses.is_dataclass(value):
        return {f.name: digest(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return [[k, digest(v)] for k, v in value.items()]
    return repr(value)


class FakeTeacher:
    """A teacher client that answers from the token ids and records the rows it is asked for (`asked`) and
    the rows of each request (`requests`: one entry per call)."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []
        self.requests: list[int] = []

    async def score_tensors(self, input_ids, response_start, top_k=None) -> ScoreTensors:
        self.asked += [list(r) for r in input_ids]
        self.requests.append(len(input_ids))
        flat = [int(t) for row, s in zip(input_ids, response_start, strict=True) for t in row[s:]]
        lengths = [len(row) - s for row, s in zip(input_ids, response_start, strict=True)]
        y = torch.tensor(flat, dtype=torch.int64)
        return ScoreTensors(
            torch.tensor(lengths, dtype=torch.int64),
            (-0.05 * (y % 7).double()).float(),
            torch.stack([y % 4, (y + 1) % 4], dim=-1).to(torch.int32),
            torch.stack(
                [(-0.05 * (y % 7).double()).float(), torch.full_like(y, -3, dtype=torch.float32)], dim=-1
            ),
            "t",
            "0",
            "fake",
        )


class FakeEngine:
    """w: [4] float64; per response token y at row b: (w[y mod 4] − target)², target = the teacher's top-1
    log-prob + 0.01·μ + 0.1·A_ORM[b]; loss = Σ / the step's global token count; SGD with lr LR."""

    def __init__(self, distributed: bool) -> None:
        self.w = torch.zeros(4, dtype=torch.float64, requires_grad=True)
        self.distributed = distributed
        self.residency = Residency(torch.nn.Linear(1, 1), torch.device("cpu"))
        self.trained: list[list[list[int]]] = []
        self.batches: list[object] = []  # `digest` of each step's batch

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t)
        return t

    def train_step(self, batch, observe=None):
        tokens = batch.tokens
        self.trained.append(tokens.input_ids.tolist())
        self.batches.append(digest(batch))
        mask = tokens.response_mask
        pred = self.w[tokens.response_ids % 4]
        target = batch.teacher_topk["t"].logprobs[..., 0].double() + 0.01 * batch.behavior_logprobs.double()
        target = target + 0.1 * batch.orm_advantages.double()[:, None]
        count = self._sum(mask.sum().double().reshape(1))[0]
        loss = torch.where(mask, (pred - target) ** 2, 0.0).sum() / count
        if observe is not None:
            observe(pred.detach().float())
        loss.backward()
        with torch.no_grad():
            grad = self._sum(self.w.grad.clone())
            self.w -= LR * grad
            self.w.grad = None
        return {"loss": float(self._sum(loss.detach().reshape(1))[0]), "tokens": float(count)}

    def load_state_dict(self, state) -> None:
        raise AssertionError("no checkpoint in these scenarios")


class FakeTPEngine(FakeEngine):
    """FakeEngine as one rank of a TP group of 2 (no DP reduction: both ranks hold the same rows); its
    "weights" are w split in two halves, one per rank, gathered over gloo by `named_weights`."""

    gathers_over_tp = True
    sharded_checkpoint = False

    def __init__(self, rank: int) -> None:
        super().__init__(distributed=False)
        self.rank, self.joined = rank, 0

    def named_weights(self):
        piece = self.w.detach()[2 * self.rank : 2 * self.rank + 2].clone()
        parts = [torch.empty_like(piece) for _ in range(2)]
        dist.all_gather(parts, piece)
        yield "w", torch.cat(parts)

    def join_weight_gather(self) -> int:
        self.joined += 1
        return sum(1 for _ in self.named_weights())


class FakeEPEngine(FakeTPEngine):
    """FakeEngine as one rank of DP 2 at expert parallel 2: each rank trains its own rows (sums over the DP
    group) and holds half of w as its "experts", gathered over gloo by `named_weights`; the follower is in rank
    0's EP group (`in_rank0_expert_group`), as the megatron engine says (engines/megatron/engine.py)."""

    gathers_over_tp = False
    gathers_over_ep = True

    def __init__(self, rank: int) -> None:
        FakeEngine.__init__(self, distributed=True)
        self.rank, self.joined = rank, 0
        self.in_rank0_expert_group = rank != 0


class FakeTPDPEngine(FakeEngine):
    """FakeEngine as one rank of TP 2 × DP 2 (world 4, rank = tp_rank + 2·dp_rank): its sums run over its
    data-parallel group (ranks {0, 2} or {1, 3}), whose ranks hold different rows; the TP ranks of a replica
    hold the same rows and reduce nothing between them."""

    def __init__(self, rank: int) -> None:
        super().__init__(distributed=True)
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both, in order
        self.dp_group = groups[rank % 2]

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.dp_group)
        return t


class FakeShardedStateEngine(FakeEngine):
    """FakeEngine whose optimizer state is DP-sharded: `state_dict` gathers every rank's shard (here the
    rank's index + 1 and its parameter) over the group, a collective the other ranks join (`join_state_dict`)."""

    collective_state_dict = True
    sharded_checkpoint = False

    def __init__(self, rank: int) -> None:
        super().__init__(distributed=True)
        self.rank, self.joined = rank, 0

    def state_dict(self) -> dict:
        shard = torch.cat([torch.tensor([self.rank + 1.0], dtype=torch.float64), self.w.detach()])
        parts = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard)
        return {"shards": [p.tolist() for p in parts]}

    def join_state_dict(self) -> None:
        self.joined += 1
        self.state_dict()


class GatherWriter:
    """A stand-in for a trainer rank's AWEX writer (trainer/rank_writer.py's `RankWriter`): `publish(step)`
    all-gathers (rank, step, its TP piece of w) over the world, so every rank must publish the same step at
    the same time; records what it gathered."""

    def __init__(self, engine: FakeEngine, rank: int, tp: int) -> None:
        self.engine, self.rank, self.tp = engine, rank, tp
        self.published: list[list[list[float]]] = []

    def publish(self, step: int) -> float:
        size = self.engine.w.numel() // self.tp
        start = (self.rank % self.tp) * size
        mine = torch.cat(
            [
                torch.tensor([self.rank, step], dtype=torch.float64),
                self.engine.w.detach()[start : start + size],
            ]
        )
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        self.published.append([p.tolist() for p in parts])
        return 0.0


async def run_rank(scenario: str, rank: int, world: int, group, busy_s: float = 0.0) -> dict:
    if scenario == "tp2":
        engine = FakeTPEngine(rank)
    elif scenario == "ep2":
        engine = FakeEPEngine(rank)
    elif scenario == "dp_checkpoint":
        engine = FakeShardedStateEngine(rank)
    elif scenario in ("tp2dp2", "writers"):
        engine = FakeTPDPEngine(rank)
    elif scenario == "tp2_nccl":  # both ranks hold every row: nothing to reduce between them
        engine = FakeEngine(distributed=False)
    else:
        engine = FakeEngine(distributed=world > 1)
    teacher = FakeTeacher()
    step = ShardStep(engine, {"t": teacher}, PLAN, LOSS, ROUTE_WEIGHTS, group)
    writer = GatherWriter(engine, rank, tp=2) if scenario == "writers" else None
    out: dict = {"rank": rank}
    if rank == 0:
        await group.publish(ControlRecord.start(0))
        group.barrier("start")
        if scenario == "rank0_dies":
            os._exit(3)
        if scenario == "rank0_freezes":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(busy_s)  # the loop and the heartbeat thread: a long evaluation or checkpoint save
        stats, receipts = [], []

        async def drained(got):
            receipts.append(got)

        for s in range(1, STEPS + 1):
            record = step_record(s)
            await group.publish(record)
            outcome = await step.run(record, on_drained=drained)
            stats.append(dict(outcome.stats))
            if scenario in ("tp2", "ep2"):  # the controller's weight sync: announce, then gather
                await group.publish(ControlRecord.weights(s, "sync"))
                out.setdefault("gathered", []).append(dict(engine.named_weights())["w"].tolist())
            if writer is not None:  # the controller's sync that every rank writes: announce, then publish
                await group.publish(ControlRecord.weights(s, "sync"))
                writer.publish(s)
            if scenario == "dp_checkpoint" and s == 2:  # the controller's checkpoint: announce, then gather
                await group.publish(ControlRecord.checkpoint(s))
                out["state"] = engine.state_dict()
        await group.publish(ControlRecord.stop(STEPS, "finished"))
        if scenario == "tp2":  # the follower makes the same all-reduce on the stop record
            out["dp_sum"] = group.all_reduce_sum([1.0])
        group.barrier("end")
        out |= {"stats": stats, "receipts": receipts}
    else:
        follower = Follower(engine, step, group, Path("."), writer)
        if scenario in ("rank1_dies", "rank1_hangs"):
            original = step.run

            async def dying(record, **kw):
                if record.step == 2 and scenario == "rank1_dies":
                    os.kill(os.getpid(), signal.SIGKILL)
                if record.step == 2:
                    time.sleep(3600)
                return await original(record, **kw)

            step.run = dying
        if scenario == "tp2":
            original_run = follower.run

            async def run_with_the_sum():  # the all-reduce rank 0 makes after its stop record
                original = group.receive

                async def receive():
                    record = await original()
                    if record.kind == "stop":
                        out["dp_sum"] = group.all_reduce_sum([1.0])
                    return record

                group.receive = receive
                return await original_run()

            follower.run = run_with_the_sum
        outcome = await follower.run()
        out |= {"outcome": [outcome.reason, outcome.step], "steps": follower.steps}
        if scenario in ("tp2", "ep2", "dp_checkpoint"):
            out["joined"] = engine.joined
    if writer is not None:
        out["published"] = writer.published
    out |= {"trained": engine.trained, "asked": teacher.asked, "requests": teacher.requests}
    out |= {"batches": engine.batches, "w": engine.w.detach().tolist()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--busy-s", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.scenario == "tp2":  # one TP group: DP rank 0 of size 1, TP rank = rank
        spec = GroupSpec(
            args.rank, args.world, 0, 1, "gloo", "cpu", args.timeout_s, 60.0, args.rank, args.world
        )
    elif args.scenario == "tp2_nccl":  # tp2's TP group on NCCL, rank r on cuda:r
        spec = GroupSpec(
            args.rank,
            args.world,
            0,
            1,
            "nccl",
            f"cuda:{args.rank}",
            args.timeout_s,
            60.0,
            args.rank,
            args.world,
        )
    elif args.scenario in ("tp2dp2", "writers"):  # rank = tp_rank + 2·dp_rank (config/parallel.py)
        spec = GroupSpec(
            args.rank, args.world, args.rank // 2, 2, "gloo", "cpu", args.timeout_s, 60.0, args.rank % 2, 2
        )
    else:
        spec = GroupSpec(args.rank, args.world, args.rank, args.world, "gloo", "cpu", args.timeout_s, 60.0)
    t0 = time.monotonic()
    result: dict = {"rank": args.rank}
    try:
        group = ActorGroup.join(spec, args.run_dir, "job-1", "127.0.0.1", args.port)
        try:
            result = asyncio.run(run_rank(args.scenario, args.rank, args.world, group, args.busy_s))
        finally:
            group.close()
    except Exception as exc:  # the tests read the error and how long it took to come
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["error_after_s"] = time.monotonic() - t0
    (args.run_dir / f"rank{args.rank}.json").write_text(json.dumps(result))
    return 1 if "error" in result else 0


def reference() -> dict:
    """The DP = 1 run of the same steps, in this process."""
    return asyncio.run(run_rank("steps", 0, 1, SoloGroup()))


def shard_batches(dp: int) -> list[list[object]]:
    """[DP rank][step − 1] → `digest` of that rank's batch at TP 1 (its shard, scored by its own teacher
    client), built in this process."""
    step = ShardStep(FakeEngine(False), {"t": FakeTeacher()}, PLAN, LOSS, ROUTE_WEIGHTS, SoloGroup())
    out: list[list[object]] = [[] for _ in range(dp)]
    for s in range(1, STEPS + 1):
        record = step_record(s)
        for shard in shard_rows(record.response_lengths, dp):
            scores = asyncio.run(step.score(record, shard))
            out[shard.rank].append(digest(shard_batch(record, shard, scores)))
    return out


if __name__ == "__main__":
    sys.exit(main())
