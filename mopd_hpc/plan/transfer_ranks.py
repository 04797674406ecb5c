"""AWEX transfer ranks of the job plan's children, and the colocated pairing AWEX's reader needs.

AWEX numbers the ranks of one weight exchange as (algo_awex.md §2.3, awex 0.9.0; pipeline size 1 here):
    transfer_rank(rollout) = engine_rank · tp + rank_in_engine      ∈ [0, infer_world)
    transfer_rank(trainer) = infer_world + trainer_rank             ∈ [infer_world, transfer_world)
    infer_world = num_engines · tp;  transfer_world = infer_world + train_world.
Rank j of a rollout engine runs on the j-th GPU the engine computes on, rank r of the trainer on actor r's.
The GPUs a child computes on are `ChildSpec.compute_gpus` (`runtime/plan.py`), the one rule the placement's
GPU-sharing check, the memory plan and the rank map also use; a rank's `device` is that GPU's ordinal among
the child's visible GPUs (CUDA_VISIBLE_DEVICES), its `gpu` the node's GPU ordinal.

Checks (DESIGN.md §4): every engine and every trainer rank has its child, once (so the transfer ranks are
unique and dense); a rollout engine computes on tp GPUs; with `pair_colocated`, trainer and rollout ranks pair one to one on
(het group, node, device ordinal) with the same node GPU (AWEX's colocate reader needs that bijection). GPUs
given to two children at once are `plan/placement.py`'s check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mopd_hpc.runtime.plan import ChildSpec

ROLLOUT_ROLE = "rollout"
TRAINER_ROLE = "actor"


class LayoutError(ValueError):
    """The job's children cannot be given transfer ranks; the message names the children and the GPU at fault."""


@dataclass(frozen=True, slots=True)
class TransferRank:
    """One rank of the AWEX weight exchange.

    Attributes:
        transfer_rank: its rank in the exchange (module docstring).
        role, child_index: the child that runs it (`ChildSpec.role`, `ChildSpec.index`).
        rank: the rank within its side (rollout: rank in engine; trainer: trainer rank).
        het_group, node_index: where the child runs.
        device: the CUDA ordinal among the child's visible GPUs; gpu: the node's GPU ordinal; both None on CPU.
    """

    transfer_rank: int
    role: str
    child_index: int
    rank: int
    het_group: int
    node_index: int
    device: int | None
    gpu: str | None

    @property
    def where(self) -> str:
        return f"het group {self.het_group} node {self.node_index}"


@dataclass(frozen=True, slots=True)
class JobLayout:
    """Transfer ranks of the whole job, sorted by transfer rank; built by `assign_transfer_ranks`."""

    infer_world: int
    train_world: int
    ranks: tuple[TransferRank, ...]

    @property
    def transfer_world(self) -> int:
        return self.infer_world + self.train_world

    def for_child(self, role: str, index: int) -> tuple[TransferRank, ...]:
        """The transfer ranks one child runs (one for a trainer, tp for a rollout engine)."""
        return tuple(r for r in self.ranks if r.role == role and r.child_index == index)


def _ranks_of(child: ChildSpec, tp: int) -> list[tuple[int | None, str | None]]:
    """(device ordinal, node GPU) of each rank `child` runs: its compute GPUs, or one CPU rank per engine rank."""
    count = tp if child.role == ROLLOUT_ROLE else 1
    gpus = child.compute_gpus(tp)
    if not child.gpus:
        return [(None, None)] * count
    if len(gpus) != count:
        raise LayoutError(
            f"rollout engine {child.label} runs {tp} ranks from device {child.device_index or 0} but is given "
            f"{len(child.gpus)} GPUs {child.gpus}; give it tp GPUs"
        )
    return [(child.gpus.index(g), g) for g in gpus]


def _check_colocated_pairs(ranks: Sequence[TransferRank], infer_world: int, train_world: int) -> None:
    if infer_world != train_world:
        raise LayoutError(
            f"colocated mode pairs each trainer rank with one rollout rank, but train_world={train_world} "
            f"!= infer_world={infer_world} (num_engines·tp); make them equal or use mode='separated'"
        )
    with_gpu = [r for r in ranks if r.device is not None]
    if not with_gpu:
        return  # CPU run: nothing to pair
    if len(with_gpu) != len(ranks):
        r = next(r for r in ranks if r.device is None)
        raise LayoutError(
            f"{r.role}[{r.child_index}] on {r.where} has no GPU while others do (colocated mode)"
        )
    infer = {(r.het_group, r.node_index, r.device): r for r in ranks if r.role == ROLLOUT_ROLE}
    paired: set[tuple[int, int, int | None]] = set()
    for r in ranks:
        if r.role == ROLLOUT_ROLE:
            continue
        key = (r.het_group, r.node_index, r.device)
        peer = infer.get(key)
        if peer is None or key in paired:
            raise LayoutError(
                f"colocated {r.role}[{r.child_index}] on {r.where} device {r.device} (GPU {r.gpu!r}) has no "
                "rollout rank of its own on the same node and device; both sides must index GPUs identically"
            )
        if peer.gpu != r.gpu:
            raise LayoutError(
                f"colocated {r.role}[{r.child_index}] and rollout[{peer.child_index}] rank {peer.rank} share "
                f"device {r.device} on {r.where} but see different GPUs ({r.gpu!r} vs {peer.gpu!r}); give both "
                "the same CUDA_VISIBLE_DEVICES order"
            )
        paired.add(key)


def assign_transfer_ranks(
    children: Sequence[ChildSpec], num_engines: int, tp: int = 1, pair_colocated: bool = False
) -> JobLayout:
    """Assign AWEX transfer ranks to the job's actor and rollout children (others are passed over).

    Args:
        children: the job plan's children; actor indices must be the trainer ranks 0..train_world-1, rollout
            indices the engines 0..num_engines-1, one child each.
        num_engines, tp: the rollout fleet (`rollout.engines.count`, `.tensor_parallel`), both >= 1.
        pair_colocated: check that trainer and rollout ranks pair one to one on the same GPU (AWEX colocate).
    Returns:
        JobLayout with one TransferRank per rollout rank and per actor child.
    Raises:
        LayoutError: a missing, duplicate or extra child, an engine given other than tp GPUs, or
            (pair_colocated) ranks that do not pair one to one.
    """
    if num_engines < 1 or tp < 1:
        raise LayoutError(f"rollout fleet num_engines={num_engines}, tp={tp}: expected integers >= 1")
    by_key: dict[tuple[str, int], ChildSpec] = {}
    for child in children:
        key = (child.role, child.index)
        if child.role in (ROLLOUT_ROLE, TRAINER_ROLE) and key in by_key:
            raise LayoutError(f"two children claim {child.label}")
        by_key[key] = child
    ranks: list[TransferRank] = []
    for engine in range(num_engines):
        child = by_key.get((ROLLOUT_ROLE, engine))
        if child is None:
            raise LayoutError(f"rollout engine {engine} has no child; num_engines={num_engines}")
        for j, (device, gpu) in enumerate(_ranks_of(child, tp)):
            ranks.append(
                TransferRank(
                    engine * tp + j, ROLLOUT_ROLE, engine, j, child.het_group, child.node_index, device, gpu
                )
            )
    extra = [c for c in children if c.role == ROLLOUT_ROLE and c.index >= num_engines]
    if extra:
        raise LayoutError(f"{extra[0].label} is outside the rollout fleet of {num_engines} engine(s)")
    trainers = sorted((c for c in children if c.role == TRAINER_ROLE), key=lambda c: c.index)
    if [c.index for c in trainers] != list(range(len(trainers))):
        raise LayoutError(f"actor indices {[c.index for c in trainers]} are not the trainer ranks 0..N-1")
    infer_world = num_engines * tp
    for child in trainers:
        ((device, gpu),) = _ranks_of(child, tp)
        ranks.append(
            TransferRank(
                infer_world + child.index, TRAINER_ROLE, child.index, child.index, child.het_group,
                child.node_index, device, gpu,
            )
        )  # fmt: skip
    ranks.sort(key=lambda r: r.transfer_rank)  # dense and unique: one child per engine and trainer rank
    if pair_colocated:
        _check_colocated_pairs(ranks, infer_world, len(trainers))
    return JobLayout(infer_world=infer_world, train_world=len(trainers), ranks=tuple(ranks))
