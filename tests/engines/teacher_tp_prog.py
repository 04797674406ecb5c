"""One rank of a tensor-parallel teacher replica for tests/engines/test_teacher_tp.py (run as a subprocess).

    python tests/engines/teacher_tp_prog.py OUT_DIR RANK WORLD PORT TOKEN

Every rank joins a gloo group (tcp://127.0.0.1:PORT) and holds its vocabulary shard of `FakeTPEngine`. Rank 0
(the leader) serves the teacher's HTTP routes over `TPLeader` on loopback, writes OUT_DIR/port.json, serves
until OUT_DIR/stop exists, then sends STOP. Every other rank runs `follow`. Each rank writes
OUT_DIR/rank<r>.json: the requests it served and, per SCORE call, the sum of the log-probs it computed (the
followers' must equal the leader's: they ran the same forward).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.mopd.topk import TeacherTopK

VOCAB, HIDDEN = 48, 16


@dataclass(frozen=True)
class Report:
    on_device: bool


class Residency:
    def __init__(self) -> None:
        self.on_device = True


class FakeTPEngine:
    """A vocabulary-parallel fake teacher: h_t = mean of the embeddings of tokens 0..t (causal), logits =
    h·W; rank r of `world` holds W's columns [r·V/world, (r+1)·V/world) and the logits are all-gathered over
    the group (the TP collective of the forward). world = 1: the whole W, no collective (the oracle)."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen)
        w = torch.randn(HIDDEN, VOCAB, generator=gen)
        size = VOCAB // world
        self.shard = w[:, rank * size : (rank + 1) * size].contiguous()
        self.world = world
        self.residency = Residency()
        self.device = torch.device("cpu")
        self.sums: list[float] = []

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def score(self, batch: TokenBatch, k: int | None = None, *, host: bool = True):  # CPU: host either way
        mask = batch.attention_mask.unsqueeze(-1).float()
        h = (self.embed[batch.input_ids] * mask).cumsum(1) / mask.cumsum(1).clamp(min=1)
        part = h @ self.shard
        if self.world > 1:
            parts = [torch.empty_like(part) for _ in range(self.world)]
            dist.all_gather(parts, part.contiguous())
            part = torch.cat(parts, dim=-1)
        width = batch.response_width
        pos = (batch.response_start.unsqueeze(1) - 1 + torch.arange(width)).clamp(max=part.shape[1] - 1)
        logits = part.gather(1, pos.unsqueeze(-1).expand(-1, -1, VOCAB))
        logsm = logits.log_softmax(-1)
        lp = logsm.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        lp = torch.where(batch.response_mask, lp, torch.full_like(lp, float("nan")))
        self.sums.append(float(lp.nan_to_num(0.0).sum()))
        return lp, (TeacherTopK.from_logits(logits, k) if k is not None else None)

    def offload(self) -> Report:
        self.residency.on_device = False
        return Report(False)

    def onload(self) -> Report:
        self.residency.on_device = True
        return Report(True)


async def lead(engine: FakeTPEngine, out: Path, token: str) -> int:
    from mopd_hpc.engines.serving import start_app
    from mopd_hpc.engines.teacher.http_app import TeacherServer
    from mopd_hpc.engines.teacher.process import teacher_app
    from mopd_hpc.engines.teacher.tensor_parallel import TPLeader

    model = out / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    leader = TPLeader(engine)
    server = TeacherServer(leader, "tp", str(model))  # type: ignore[arg-type]
    runner, port, _ = await start_app(teacher_app(server, token), "127.0.0.1", 0, asyncio.Event())
    (out / "port.json").write_text(json.dumps({"port": port}))
    try:
        while not (out / "stop").exists():
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
        leader.stop()
    return leader.requests


def main(argv: list[str]) -> int:
    out, rank, world, port, token = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    engine = FakeTPEngine(rank, world)
    t0 = time.monotonic()
    if rank == 0:
        served = asyncio.run(lead(engine, out, token))
    else:
        from mopd_hpc.engines.teacher.tensor_parallel import follow

        served = follow(engine)
    record = {"served": served, "sums": engine.sums, "resident": engine.residency.on_device}
    (out / f"rank{rank}.json").write_text(json.dumps(record | {"seconds": time.monotonic() - t0}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
