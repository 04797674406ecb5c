"""The actor group's parallel shape: its world (the trainer slots) = dp × pp × tp, and each rank's place in it.

    from mopd_hpc.config.parallel import ActorParallel
    shape = ActorParallel.from_config(cfg)          # world 2 = dp 2 × tp 1 × pp 1
    shape.dp_rank(rank), shape.tp_rank(rank)        # rank = MOPD_RANK of an actor child

World (`actor_world`): one actor rank per trainer slot, as `plan/placement.py` lays the actor out:
- a group with GPUs: nodes × gpus_per_node (one rank per GPU), less the rollout engines' GPUs
  (rollout.engines count·tensor_parallel) in the colocated shape with rollout.mode separated;
- a group without GPUs: nodes × actor_ranks_per_node (`cluster.<group>.actor_ranks_per_node`, null = 1).

Sizes (torchtitan's `ParallelDims`: the sizes multiply to the world, or an error naming each):
tp = models.actor.tensor_parallel, pp = models.actor.pipeline_parallel, dp = world / (tp·pp).

Rank order (megatron-core `parallel_state.initialize_model_parallel`, default order "tp-cp-ep-dp-pp" with
cp = ep = 1): TP innermost, then DP, then PP outermost:

    rank = tp_rank + tp · (dp_rank + dp · pp_rank)

so the ranks of one TP group are consecutive (one node: TP never spans nodes, config/rules.py) and DP rank 0
of every (pp, tp) coordinate is a rank < tp on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ParallelError(ValueError):
    """The parallel sizes do not multiply to the world, or a rank is outside it; the message names the fields."""


@dataclass(frozen=True, slots=True)
class ActorWorld:
    """How many actor ranks the trainer slots give, and how they were counted.

    Attributes:
        size: the actor's world size (may be <= 0 when separated rollout engines take every GPU: a config
            error that `config/rules.py` reports).
        how: the count in field names, e.g. "cluster.group.nodes × actor_ranks_per_node = 1 × 2".
        group_path: the YAML path of the group that holds the actor ("cluster.trainer" or "cluster.group").
    """

    size: int
    how: str
    group_path: str


def actor_world(cluster: Any, rollout: Any) -> ActorWorld:
    """The actor's world from a validated `ClusterConfig` and `RolloutConfig` (module docstring)."""
    group = cluster.trainer_group
    where = "cluster.trainer" if cluster.shape == "heterogeneous" else "cluster.group"
    if group.gpus_per_node == 0:
        per_node = group.actor_slots_per_node
        how = f"{where}.nodes × actor_ranks_per_node = {group.nodes} × {per_node}"
        return ActorWorld(group.nodes * per_node, how, where)
    size = group.nodes * group.gpus_per_node
    how = f"{where}.nodes × gpus_per_node = {group.nodes} × {group.gpus_per_node}"
    if cluster.shape == "colocated" and rollout.mode == "separated":
        engines = rollout.engines
        how += f" − rollout.engines count·tensor_parallel {engines.count}·{engines.tensor_parallel}"
        size -= engines.count * engines.tensor_parallel
    return ActorWorld(size, how, where)


def teacher_replicas(cfg: Any, teacher: Any) -> int:
    """The scoring servers of `teacher` (a `TeacherConfig` of the validated `cfg`): its `replicas`, or when
    null, on a trainer group with GPUs the actor's world ÷ its tensor_parallel (one replica per
    tensor-parallel group of the actor's GPUs, `plan/placement.py`), on CPU 1."""
    if teacher.replicas is not None:
        return int(teacher.replicas)
    if cfg.cluster.trainer_group.gpus_per_node == 0:
        return 1
    return max(1, actor_world(cfg.cluster, cfg.rollout).size // teacher.tensor_parallel)


def divisors(n: int) -> str:
    """'1, 2, 4 or 8' for 8."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else f"{', '.join(ds[:-1])} or {ds[-1]}"


def indivisible_message(world: int, tp: int, pp: int) -> str:
    """The ParallelDims-style statement of a world that tp·pp does not divide (no whole dp)."""
    return (
        f"dp · tp({tp}) · pp({pp}) != world({world}) for any whole dp: models.actor.tensor_parallel · "
        f"pipeline_parallel = {tp * pp} must divide the actor's world {world}"
    )


@dataclass(frozen=True, slots=True)
class RankCoords:
    """One actor rank's coordinates: its DP, PP and TP ranks (each 0-based, below its size)."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True, slots=True)
class ActorParallel:
    """The actor group's shape: `world` ranks = `dp` × `pp` × `tp`. Build with `from_config` or `from_sizes`.

    Attributes:
        world: actor ranks (trainer slots), MOPD_WORLD_SIZE of every actor child.
        dp: data-parallel size = world / (tp·pp).
        tp: tensor-parallel size (models.actor.tensor_parallel).
        pp: pipeline-parallel size (models.actor.pipeline_parallel).
        source: how the world was counted, in field names (for messages; not compared).
    Raises (construction):
        ParallelError: a size below 1, or dp·tp·pp != world.
    """

    world: int
    dp: int
    tp: int
    pp: int
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("world", "dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelError(f"actor parallel {name}={value!r}: expected an integer >= 1")
        if self.dp * self.tp * self.pp != self.world:
            raise ParallelError(
                f"dp({self.dp}) · tp({self.tp}) · pp({self.pp}) != world({self.world}): the sizes must "
                "multiply to the actor's world"
            )

    @classmethod
    def from_sizes(cls, world: int, tp: int = 1, pp: int = 1, source: str = "") -> ActorParallel:
        """dp = world / (tp·pp). Raises ParallelError (naming models.actor.tensor_parallel and
        pipeline_parallel, and the divisors of the world) when tp·pp does not divide it."""
        if world < 1:
            raise ParallelError(f"the actor's world is {world} ({source or 'trainer slots'}): expected >= 1")
        if tp < 1 or pp < 1 or world % (tp * pp):
            where = f" ({source})" if source else ""
            raise ParallelError(
                f"{indivisible_message(world, tp, pp)}{where}; choose tensor_parallel·pipeline_parallel among "
                f"{divisors(world)}, or change the trainer slots"
            )
        return cls(world=world, dp=world // (tp * pp), tp=tp, pp=pp, source=source)

    @classmethod
    def from_config(cls, cfg: Any) -> ActorParallel:
        """The shape of a validated RunConfig (`actor_world` of its cluster and rollout, the actor's tp and pp).

        Raises:
            ParallelError: the config's sizes do not divide (cannot happen for a config that passed
                `load_run_config`: config/rules.py reports it as a problem first).
        """
        world = actor_world(cfg.cluster, cfg.rollout)
        actor = cfg.models.actor
        return cls.from_sizes(world.size, actor.tensor_parallel, actor.pipeline_parallel, world.how)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ParallelError(f"actor rank {rank!r}: expected an integer in [0, world={self.world})")

    def coords(self, rank: int) -> RankCoords:
        """(dp, pp, tp) ranks of actor `rank` (rank = tp_rank + tp·(dp_rank + dp·pp_rank)).
        Raises ParallelError for a rank outside [0, world)."""
        self._check_rank(rank)
        return RankCoords(dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp), tp=rank % self.tp)

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank).dp

    def tp_rank(self, rank: int) -> int:
        return self.coords(rank).tp

    def pp_rank(self, rank: int) -> int:
        return self.coords(rank).pp

    def rank(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """Inverse of `coords`. Raises ParallelError for a coordinate outside its size."""
        for name, value, size in (("dp", dp, self.dp), ("pp", pp, self.pp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ParallelError(f"{name} rank {value}: expected in [0, {name} size {size})")
        return tp + self.tp * (dp + self.dp * pp)

    def dp_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s data-parallel group (same pp and tp ranks), in DP order: DDP's group."""
        c = self.coords(rank)
        return tuple(self.rank(dp=d, pp=c.pp, tp=c.tp) for d in range(self.dp))

    def tp_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s tensor-parallel group (same dp and pp ranks), in TP order (consecutive)."""
        c = self.coords(rank)
        return tuple(self.rank(dp=c.dp, pp=c.pp, tp=t) for t in range(self.tp))

    def describe(self) -> str:
        """'world 2 = dp 2 × tp 1 × pp 1'."""
        return f"world {self.world} = dp {self.dp} × tp {self.tp} × pp {self.pp}"
