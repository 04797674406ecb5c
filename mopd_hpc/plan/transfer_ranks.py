"""Job-level layout: AWEX transfer ranks for every child, and the checks to run before spawning.

AWEX numbers the ranks of one weight exchange as (algo_awex.md §2.3, awex 0.9.0):
    transfer_rank(rollout) = engine_rank · (tp · pp) + rank_in_engine      ∈ [0, infer_world)
    transfer_rank(trainer) = infer_world + trainer_rank                    ∈ [infer_world, transfer_world)
    infer_world = num_engines · tp · pp;  transfer_world = infer_world + train_world.
A rollout engine spanning `nodes_per_engine` nodes has one child per node; node k of the engine
runs ranks [k·R, (k+1)·R) with R = tp·pp / nodes_per_engine, rank k·R + j on the child's device
`base + j` (SGLang's base_gpu_id; base = the child's local_device_index, default 0).

Checks (DESIGN.md §4): transfer ranks unique and dense; no physical GPU given to two children that
run at the same time (separated mode: any two children; colocated mode: two children of the same
role — actor, teacher and rollout share GPUs by design there); in colocated mode trainer and rollout
ranks pair one to one on (host, local device index), with the same physical GPU (AWEX's reader
needs that bijection). Inputs are plain ints, strings and the frozen records below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mopd_hpc.runtime.topology import RankTopology

MODES: tuple[str, ...] = ("separated", "colocated")
ROLLOUT_ROLE = "rollout"
TRAINER_ROLE = "actor"


class LayoutError(ValueError):
    """The job's children cannot be laid out; the message names the children and the GPU at fault."""


@dataclass(frozen=True, slots=True)
class ChildPlacement:
    """One child process the guards will spawn, and the GPUs it is given.

    Fields:
        role: "actor", "teacher", "rollout", ...
        index: trainer rank for actor/teacher children; engine rank for rollout children.
        host: the host name (as Slurm names it).
        gpu_tokens: the child's CUDA_VISIBLE_DEVICES tokens, strings as given ("3", "GPU-…", "MIG-…").
        local_device_index: the device ordinal it uses (trainer) or its first device (rollout's
            base_gpu_id); None: every token (trainer) / 0 (rollout).
        physical_gpus: physical id per token where known (default: the tokens themselves).
        node_rank: for a rollout engine spanning nodes, which node of the engine this child is.
    """

    role: str
    index: int
    host: str
    gpu_tokens: tuple[str, ...] = ()
    local_device_index: int | None = None
    physical_gpus: tuple[str, ...] | None = None
    node_rank: int = 0

    def __post_init__(self) -> None:
        name = f"child {self.role}[{self.index}]"
        if not self.role or not self.host:
            raise LayoutError(f"{name}: role={self.role!r} and host={self.host!r} must be non-empty")
        if self.index < 0 or self.node_rank < 0:
            raise LayoutError(f"{name}: index={self.index}, node_rank={self.node_rank} must be >= 0")
        if len(set(self.gpu_tokens)) != len(self.gpu_tokens):
            raise LayoutError(f"{name} on {self.host}: gpu_tokens={self.gpu_tokens} lists a GPU twice")
        if self.physical_gpus is not None and len(self.physical_gpus) != len(self.gpu_tokens):
            raise LayoutError(f"{name}: physical_gpus={self.physical_gpus} needs one id per gpu token")
        ldi = self.local_device_index
        if ldi is not None and not 0 <= ldi < len(self.gpu_tokens):
            raise LayoutError(f"{name}: local_device_index={ldi} not in [0, {len(self.gpu_tokens)})")

    @classmethod
    def from_topology(
        cls, topo: RankTopology, index: int | None = None, node_rank: int = 0
    ) -> ChildPlacement:
        """The placement a child's own descriptor reports (e.g. from a `probe`); index defaults to its rank."""
        if topo.role is None:
            raise LayoutError(f"descriptor of rank {topo.rank} on {topo.hostname} has no role")
        return cls(
            role=topo.role,
            index=topo.rank if index is None else index,
            host=topo.hostname,
            gpu_tokens=topo.gpu_tokens,
            local_device_index=topo.local_device_index,
            physical_gpus=topo.physical_gpus,
            node_rank=node_rank,
        )

    @property
    def label(self) -> str:
        suffix = f" node {self.node_rank}" if self.node_rank else ""
        return f"{self.role}[{self.index}]{suffix} on {self.host}"

    def physical(self, device: int) -> str:
        return (self.physical_gpus or self.gpu_tokens)[device]


@dataclass(frozen=True, slots=True)
class RolloutLayout:
    """The rollout fleet: `num_engines` engines of tp·pp ranks each (dp = 1, algo_awex.md §2.3)."""

    num_engines: int
    tp: int = 1
    pp: int = 1
    nodes_per_engine: int = 1

    def __post_init__(self) -> None:
        for name in ("num_engines", "tp", "pp", "nodes_per_engine"):
            if getattr(self, name) < 1:
                raise LayoutError(f"rollout layout {name}={getattr(self, name)}: expected an integer >= 1")
        if self.ranks_per_engine % self.nodes_per_engine:
            raise LayoutError(
                f"rollout layout tp·pp={self.ranks_per_engine} does not split over "
                f"nodes_per_engine={self.nodes_per_engine}; each node of an engine runs the same number of ranks"
            )

    @property
    def ranks_per_engine(self) -> int:
        return self.tp * self.pp

    @property
    def ranks_per_node(self) -> int:
        return self.ranks_per_engine // self.nodes_per_engine

    @property
    def infer_world(self) -> int:
        return self.num_engines * self.ranks_per_engine


@dataclass(frozen=True, slots=True)
class TransferRank:
    """One rank of the AWEX weight exchange.

    rank: the rank within its side (rollout: rank in engine; trainer: trainer rank).
    device: CUDA ordinal in the child's CUDA_VISIBLE_DEVICES; gpu: physical id; both None without GPU.
    """

    transfer_rank: int
    role: str
    child_index: int
    rank: int
    host: str
    device: int | None
    gpu: str | None


@dataclass(frozen=True, slots=True)
class JobLayout:
    """Transfer ranks of the whole job, sorted by transfer rank; built by `assign_transfer_ranks`."""

    mode: str
    infer_world: int
    train_world: int
    ranks: tuple[TransferRank, ...]

    @property
    def transfer_world(self) -> int:
        return self.infer_world + self.train_world

    def for_child(self, role: str, index: int) -> tuple[TransferRank, ...]:
        """The transfer ranks one child runs (one for a trainer, tp·pp/nodes for a rollout child)."""
        return tuple(r for r in self.ranks if r.role == role and r.child_index == index)


def _used_devices(child: ChildPlacement, rollout: RolloutLayout) -> list[int]:
    """The device ordinals a child works on (rollout: its engine ranks; others: its device or all)."""
    if child.role == ROLLOUT_ROLE:
        if not child.gpu_tokens:
            return []
        base = child.local_device_index or 0
        if base + rollout.ranks_per_node > len(child.gpu_tokens):
            raise LayoutError(
                f"rollout child {child.label} runs {rollout.ranks_per_node} ranks from device {base} but is "
                f"given {len(child.gpu_tokens)} GPUs {child.gpu_tokens}; give it tp·pp/nodes GPUs"
            )
        return list(range(base, base + rollout.ranks_per_node))
    if child.local_device_index is not None:
        return [child.local_device_index]
    return list(range(len(child.gpu_tokens)))


def _check_exclusive(children: Sequence[ChildPlacement], rollout: RolloutLayout, mode: str) -> None:
    owners: dict[tuple[str, str], ChildPlacement] = {}
    for child in children:
        for device in _used_devices(child, rollout):
            key = (child.host, child.physical(device))
            other = owners.get(key)
            if other is not None and (mode == "separated" or other.role == child.role):
                why = "in separated mode" if mode == "separated" else f"both {child.role} in colocated mode"
                raise LayoutError(
                    f"GPU {key[1]!r} on {key[0]} is given to both {other.label} and {child.label}, which run at "
                    f"the same time ({why}); give each child its own GPU"
                )
            owners.setdefault(key, child)


def check_transfer_ranks(ranks: Sequence[TransferRank], world: int) -> None:
    """Raise LayoutError unless the transfer ranks are unique and exactly 0..world-1.

    Also usable on ranks reported back by running children (e.g. `probe` records).
    """
    seen: dict[int, TransferRank] = {}
    for r in ranks:
        if r.transfer_rank in seen:
            a = seen[r.transfer_rank]
            raise LayoutError(
                f"transfer rank {r.transfer_rank} is held by both {a.role}[{a.child_index}] and "
                f"{r.role}[{r.child_index}]; check the children's indices"
            )
        seen[r.transfer_rank] = r
    missing = sorted(set(range(world)) - set(seen))
    if missing or len(seen) != world:
        raise LayoutError(f"transfer ranks are not dense in [0, {world}): missing {missing}")


def _check_colocated_pairs(ranks: Sequence[TransferRank], infer_world: int, train_world: int) -> None:
    if infer_world != train_world:
        raise LayoutError(
            f"colocated mode pairs each trainer rank with one rollout rank, but train_world={train_world} "
            f"!= infer_world={infer_world} (num_engines·tp·pp); make them equal or use mode='separated'"
        )
    with_gpu = [r for r in ranks if r.device is not None]
    if not with_gpu:
        return  # CPU run: nothing to pair
    if len(with_gpu) != len(ranks):
        r = next(r for r in ranks if r.device is None)
        raise LayoutError(
            f"{r.role}[{r.child_index}] on {r.host} has no GPU while others do (colocated mode)"
        )
    infer = {(r.host, r.device): r for r in ranks if r.role == ROLLOUT_ROLE}
    paired: set[tuple[str, int | None]] = set()
    for r in ranks:
        if r.role == ROLLOUT_ROLE:
            continue
        peer = infer.get((r.host, r.device))
        if peer is None or (r.host, r.device) in paired:
            raise LayoutError(
                f"colocated {r.role}[{r.child_index}] on {r.host} device {r.device} (GPU {r.gpu!r}) has no "
                "rollout rank of its own on the same (host, device); both sides must index GPUs identically"
            )
        if peer.gpu != r.gpu:
            raise LayoutError(
                f"colocated {r.role}[{r.child_index}] and rollout[{peer.child_index}] rank {peer.rank} share "
                f"device {r.device} on {r.host} but see different GPUs ({r.gpu!r} vs {peer.gpu!r}); give both "
                "the same CUDA_VISIBLE_DEVICES order"
            )
        paired.add((r.host, r.device))


def assign_transfer_ranks(
    children: Sequence[ChildPlacement], rollout: RolloutLayout, mode: str = "separated"
) -> JobLayout:
    """Assign AWEX transfer ranks to the job's children and run the pre-spawn checks.

    Args:
        children: every child of the job (actor, teacher, rollout, ...); actor indices must be the
            trainer ranks 0..train_world-1; rollout children cover engines 0..num_engines-1, one per
            node of each engine.
        rollout: the rollout fleet's shape.
        mode: "separated" or "colocated".
    Returns:
        JobLayout with one TransferRank per rollout rank and per actor child.
    Raises:
        LayoutError: a missing or duplicate child, transfer ranks not unique and dense, a GPU given
            twice, or colocated ranks that do not pair one to one.
    """
    if mode not in MODES:
        raise LayoutError(f"mode={mode!r}: expected one of {MODES}")
    by_key: dict[tuple[str, int, int], ChildPlacement] = {}
    for child in children:
        key = (child.role, child.index, child.node_rank)
        if key in by_key:
            raise LayoutError(
                f"two children claim {child.role}[{child.index}]: {by_key[key].label} and {child.label}"
            )
        by_key[key] = child
    ranks: list[TransferRank] = []
    for engine in range(rollout.num_engines):
        for node in range(rollout.nodes_per_engine):
            child = by_key.get((ROLLOUT_ROLE, engine, node))
            if child is None:
                raise LayoutError(
                    f"rollout engine {engine} node {node} has no child; num_engines={rollout.num_engines}, "
                    f"nodes_per_engine={rollout.nodes_per_engine}"
                )
            devices = _used_devices(child, rollout) or [None] * rollout.ranks_per_node
            for j, device in enumerate(devices):
                rank = node * rollout.ranks_per_node + j
                gpu = None if device is None else child.physical(device)
                tr = engine * rollout.ranks_per_engine + rank
                ranks.append(TransferRank(tr, ROLLOUT_ROLE, engine, rank, child.host, device, gpu))
    extra = [c for c in children if c.role == ROLLOUT_ROLE and c.index >= rollout.num_engines]
    extra += [c for c in children if c.role == ROLLOUT_ROLE and c.node_rank >= rollout.nodes_per_engine]
    if extra:
        raise LayoutError(f"{extra[0].label} is outside the rollout layout {rollout}")
    trainers = sorted((c for c in children if c.role == TRAINER_ROLE), key=lambda c: c.index)
    if [c.index for c in trainers] != list(range(len(trainers))):
        raise LayoutError(f"actor indices {[c.index for c in trainers]} are not the trainer ranks 0..N-1")
    for child in trainers:
        device = child.local_device_index
        if device is None and len(child.gpu_tokens) == 1:
            device = 0
        if device is None and child.gpu_tokens:
            raise LayoutError(f"{child.label} sees GPUs {child.gpu_tokens} but names no local_device_index")
        gpu = None if device is None else child.physical(device)
        tr = rollout.infer_world + child.index
        ranks.append(TransferRank(tr, TRAINER_ROLE, child.index, child.index, child.host, device, gpu))
    ranks.sort(key=lambda r: r.transfer_rank)
    check_transfer_ranks(ranks, rollout.infer_world + len(trainers))
    _check_exclusive(children, rollout, mode)
    if mode == "colocated":
        _check_colocated_pairs(ranks, rollout.infer_world, len(trainers))
    return JobLayout(
        mode=mode, infer_world=rollout.infer_world, train_world=len(trainers), ranks=tuple(ranks)
    )
