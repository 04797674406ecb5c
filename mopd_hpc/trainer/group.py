"""The actor group as the step loop uses it: the `Group` interface (trainer/actor_group.py's `ActorGroup`, one
rank of a torch.distributed world, and `SoloGroup`), the errors a group raises, and `SoloGroup`, the group of one
rank (world size 1): no torch.distributed at all, the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mopd_hpc.trainer.step_record import ControlRecord


class ActorGroupError(RuntimeError):
    """The actor group cannot be formed or used (bad rank/world, backend, a record out of order)."""


class PeerLostError(ActorGroupError):
    """A rank of the actor group is gone or silent: a collective failed or timed out, or rank 0's store
    is unreachable. A consequence of another rank's failure, as a rule (module docstring)."""


def group_settings_problem(
    backend: str, collective_timeout_s: float, rendezvous_timeout_s: float
) -> str | None:
    """What is wrong with the settings of a torch.distributed group of the job (the actor group, a teacher's TP
    group), or None: the backend is 'gloo' (CPU) or 'nccl' (GPU), and both timeouts (seconds) are > 0."""
    if backend not in ("gloo", "nccl"):
        return f"backend={backend!r}: expected 'gloo' (CPU) or 'nccl' (GPU)"
    if collective_timeout_s <= 0 or rendezvous_timeout_s <= 0:
        return (
            f"collective_timeout_s={collective_timeout_s}, rendezvous_timeout_s={rendezvous_timeout_s}: "
            "expected > 0"
        )
    return None


#: (rank, step, rows scored) of each rank, at rank 0.
Receipts = list[tuple[int, int, int]]


class Group(Protocol):
    """The actor group as the step loop uses it (`ActorGroup`, `SoloGroup`)."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int

    async def publish(self, record: ControlRecord) -> None: ...

    async def receive(self) -> ControlRecord: ...

    def gather_receipts(self, step: int, rows: int) -> Receipts | None: ...

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]: ...

    def barrier(self, what: str) -> None: ...

    def tp_broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]: ...

    def forget_read_records(self) -> None: ...

    def close(self) -> None: ...


class SoloGroup:
    """The actor group of one rank: no torch.distributed, no store (module docstring)."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1
    tp_rank = 0
    tp_size = 1

    async def publish(self, record: ControlRecord) -> None:
        del record

    async def receive(self) -> ControlRecord:
        raise ActorGroupError("rank 0 of a one-rank actor group receives no control record (a bug)")

    def gather_receipts(self, step: int, rows: int) -> Receipts:
        return [(0, step, rows)]

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def barrier(self, what: str) -> None:
        del what

    def tp_broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        del what
        return list(tensors)

    def forget_read_records(self) -> None:
        pass

    def close(self) -> None:
        pass
