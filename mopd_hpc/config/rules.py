"""Cross-section rules of the run config: everything that needs two sections to decide.

Rules inside one section live in that section's validator. Each rule here declares the sections it
reads; the loader runs every rule whose sections are valid, even when other sections are not, so one
`ConfigError` lists every problem it can find. Paths are absolute.

Decisions (documented here, tested in tests/test_config_errors.py):
- a route that no source uses is an ERROR (most often a typo in a source's `route`; an unused route
  would load and score its teachers for nothing);
- a teacher with no positive weight in any route is a WARNING (`config_warnings`): it is how a user
  switches a teacher off with `--set routes.R.T=0` for one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mopd_hpc.config.data import unevaluated_sources
from mopd_hpc.config.gaps import job_gaps
from mopd_hpc.config.problems import Problem, join_path, known

RuleFn = Callable[[Any], Iterator[Problem]]


@dataclass(frozen=True, slots=True)
class Rule:
    needs: tuple[str, ...]
    fn: RuleFn


RULES: list[Rule] = []


def rule(*needs: str) -> Callable[[RuleFn], RuleFn]:
    """Register a cross-section rule that reads the top-level sections/fields `needs`."""

    def register(fn: RuleFn) -> RuleFn:
        RULES.append(Rule(needs, fn))
        return fn

    return register


class _View:
    """Attribute access to the valid top-level values (a stand-in for a RunConfig)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)


def check(values: Mapping[str, Any]) -> list[Problem]:
    """Run every rule whose needed top-level values are all present in `values` (name → validated value)."""
    view = _View(values)
    problems: list[Problem] = []
    for r in RULES:
        if all(name in values for name in r.needs):
            problems.extend(r.fn(view))
    return problems


@rule("routes")
def _route_weights(c: Any) -> Iterator[Problem]:
    for route, weights in c.routes.items():
        if not any(w > 0 for w in weights.values()):
            yield Problem(
                join_path("routes", route),
                "no teacher has a weight > 0" if weights else "no teacher",
                weights,
                "at least one teacher weight > 0",
            )


@rule("routes", "models")
def _route_teachers(c: Any) -> Iterator[Problem]:
    ids = c.models.teacher_ids
    for route, weights in c.routes.items():
        for teacher in weights:
            if teacher not in ids:
                yield Problem(join_path("routes", route), f"unknown teacher {teacher!r}", expected=known(ids))


@rule("routes", "data")
def _source_routes(c: Any) -> Iterator[Problem]:
    for i, source in enumerate(c.data.sources):
        if source.route not in c.routes:
            yield Problem(
                join_path("data", "sources", i, "route"),
                f"unknown route {source.route!r}",
                expected=known(c.routes),
            )
    used = set(c.data.routes_used)
    for route in c.routes:
        if route not in used:
            yield Problem(
                join_path("routes", route),
                "no source in data.sources uses this route",
                expected="remove it, or give a source `route: " + route + "`",
            )


def _needs_gpus(path: str, what: str, value: object, group_path: str, way_out: str = "use 1") -> Problem:
    return Problem(
        path,
        f"{what} needs GPUs, but {group_path}.gpus_per_node is 0",
        value,
        f"{way_out}, or give the group GPUs",
    )


def _divisors(n: int) -> str:
    """'1, 2, 4 or 8' for 8."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else f"{', '.join(ds[:-1])} or {ds[-1]}"


def _parallel_problems(
    path: str, tp: int, pp: int, gpus_per_node: int, gpus: int, group_path: str, gpus_label: str = ""
) -> Iterator[Problem]:
    """tp must divide the group's GPUs per node (TP stays inside a node); tp·pp must divide its GPUs."""
    if gpus_per_node == 0:
        if tp > 1:
            yield _needs_gpus(f"{path}.tensor_parallel", "tensor parallelism", tp, group_path)
        if pp > 1:
            yield _needs_gpus(f"{path}.pipeline_parallel", "pipeline parallelism", pp, group_path)
        return
    if gpus_per_node % tp:
        yield Problem(
            f"{path}.tensor_parallel",
            f"must divide {group_path}.gpus_per_node ({gpus_per_node})",
            tp,
            f"a divisor of the GPUs per node: {_divisors(gpus_per_node)}",
        )
    elif gpus % (tp * pp):
        yield Problem(
            path,
            f"tensor_parallel·pipeline_parallel = {tp}·{pp} = {tp * pp} must divide the GPUs of {group_path} "
            f"({gpus}{gpus_label or ' = nodes·gpus_per_node'})",
            tp * pp,
            "a divisor of the group's GPUs",
        )


def _trainer_path(cluster: Any) -> str:
    return "cluster.trainer" if cluster.shape == "heterogeneous" else "cluster.group"


def _rollout_path(cluster: Any) -> str:
    return "cluster.rollout" if cluster.shape == "heterogeneous" else "cluster.group"


def _actor_gpus(c: Any) -> int:
    """GPUs the actor spreads over: the trainer group's, less the rollout's in a separated colocated shape."""
    group = c.cluster.trainer_group
    if c.cluster.shape == "colocated" and c.rollout.mode == "separated":
        return group.gpus - c.rollout.engines.count * c.rollout.engines.tensor_parallel
    return group.gpus


@rule("models", "cluster", "rollout")
def _actor_layout(c: Any) -> Iterator[Problem]:
    actor, group, where = c.models.actor, c.cluster.trainer_group, _trainer_path(c.cluster)
    if actor.engine == "megatron" and group.gpus_per_node == 0:
        yield _needs_gpus(
            "models.actor.engine", "the megatron engine", actor.engine, where, "use engine: torch"
        )
        return
    gpus = _actor_gpus(c)
    if group.gpus_per_node and gpus <= 0:
        yield Problem(
            "rollout.engines",
            f"rollout engines take all {group.gpus} GPUs of {where}, none left for the actor",
            c.rollout.engines.count * c.rollout.engines.tensor_parallel,
            "fewer engines, or rollout.mode: colocated",
        )
        return
    label = "" if gpus == group.gpus else " left after the rollout engines' GPUs"
    yield from _parallel_problems(
        "models.actor",
        actor.tensor_parallel,
        actor.pipeline_parallel,
        group.gpus_per_node,
        gpus,
        where,
        label,
    )


def _actor_ranks(c: Any) -> tuple[int, str]:
    """(the actor's trainer ranks, how they are counted), as launch/placement.py place_children lays them:
    one rank per trainer slot (nodes × max(1, gpus_per_node)), less the rollout engines' GPUs
    (count·tensor_parallel) when the colocated shape runs rollout.mode separated on GPUs."""
    group, where = c.cluster.trainer_group, _trainer_path(c.cluster)
    slots = group.nodes * max(1, group.gpus_per_node)
    how = f"{where}.nodes × max(1, gpus_per_node) = {group.nodes} × {max(1, group.gpus_per_node)}"
    if c.cluster.shape == "colocated" and c.rollout.mode == "separated" and group.gpus_per_node:
        engines = c.rollout.engines
        how += f" − rollout.engines count·tensor_parallel {engines.count}·{engines.tensor_parallel}"
        return slots - engines.count * engines.tensor_parallel, how
    return slots, how


@rule("models", "cluster", "rollout")
def _torch_actor_world(c: Any) -> Iterator[Problem]:
    """The torch engine trains on one process (roles/actor.py check_actor_engine): one trainer rank."""
    if c.models.actor.engine != "torch":
        return
    ranks, how = _actor_ranks(c)
    if ranks > 1:  # ranks <= 0 is `_actor_layout`'s problem
        where = _trainer_path(c.cluster)
        yield Problem(
            "models.actor.engine",
            f"the torch engine trains on one process, but the actor has {ranks} trainer ranks ({how})",
            "torch",
            f"one trainer slot ({where}.nodes: 1 and gpus_per_node ≤ 1), or engine: megatron",
        )


@rule("models", "cluster")
def _teacher_layout(c: Any) -> Iterator[Problem]:
    group, where = c.cluster.trainer_group, _trainer_path(c.cluster)
    for i, teacher in enumerate(c.models.teachers):
        path = join_path("models", "teachers", i)
        if teacher.engine == "megatron" and group.gpus_per_node == 0:
            yield _needs_gpus(
                f"{path}.engine", "the megatron engine", teacher.engine, where, "use engine: torch"
            )
            continue
        yield from _parallel_problems(
            path, teacher.tensor_parallel, 1, group.gpus_per_node, group.gpus, where
        )


@rule("rollout", "cluster")
def _rollout_layout(c: Any) -> Iterator[Problem]:
    rollout, cluster = c.rollout, c.cluster
    group, where = cluster.rollout_group, _rollout_path(cluster)
    if cluster.shape == "heterogeneous" and rollout.mode == "colocated":
        yield Problem(
            "rollout.mode",
            "a heterogeneous job puts the rollout on its own group",
            rollout.mode,
            "rollout.mode: separated, or cluster.shape: colocated",
        )
    if rollout.backend == "sglang" and group.gpus_per_node == 0:
        yield _needs_gpus("rollout.backend", "the sglang backend", rollout.backend, where, "use backend: hf")
        return
    engines = rollout.engines
    yield from _parallel_problems(
        "rollout.engines", engines.tensor_parallel, 1, group.gpus_per_node, group.gpus, where
    )
    # an engine wider than the whole group is the tensor_parallel problem above, not a count problem
    fits = engines.tensor_parallel <= group.gpus
    if group.gpus_per_node and fits and engines.count * engines.tensor_parallel > group.gpus:
        yield Problem(
            "rollout.engines.count",
            f"count·tensor_parallel = {engines.count}·{engines.tensor_parallel} exceeds the {group.gpus} GPUs of {where}",
            engines.count,
            f"at most {group.gpus // engines.tensor_parallel}",
        )


@rule("weight_sync", "rollout", "models")
def _awex(c: Any) -> Iterator[Problem]:
    if c.weight_sync.backend != "awex":
        return
    if c.rollout.backend == "hf" and c.rollout.engines.tensor_parallel != 1:
        yield Problem(
            "rollout.engines.tensor_parallel",
            "the HF rollout engine's AWEX reader (engines/weight_sync/awex_hf.py) is one process",
            c.rollout.engines.tensor_parallel,
            "expected 1, or rollout.backend: sglang",
        )
    if c.models.actor.engine != "megatron":
        yield Problem(
            "weight_sync.backend",
            f"the AWEX writer needs a megatron actor; models.actor.engine is {c.models.actor.engine!r}",
            "awex",
            "models.actor.engine: megatron, or weight_sync.backend: torch",
        )
    expected = {"colocated": "colocate", "separated": "separate"}[c.rollout.mode]
    if c.weight_sync.awex_mode not in (None, expected):
        yield Problem(
            "weight_sync.awex_mode",
            f"does not match rollout.mode {c.rollout.mode!r}",
            c.weight_sync.awex_mode,
            f"{expected!r}, or null to follow rollout.mode",
        )


@rule("weight_sync", "rollout", "cluster")
def _awex_colocate(c: Any) -> Iterator[Problem]:
    """AWEX colocate mode pairs every trainer rank with one rollout rank on the same GPU (its reader
    requires that bijection, algo_awex.md §2.3): the rollout ranks must cover the actor's GPUs exactly.
    Colocate mode is weight_sync.awex_mode, or rollout.mode colocated when it is null; an awex_mode that
    contradicts rollout.mode is `_awex`'s problem alone (one cause, one problem)."""
    if c.weight_sync.backend != "awex" or c.rollout.mode != "colocated":
        return
    if c.weight_sync.awex_mode not in (None, "colocate"):
        return
    group, engines = c.cluster.trainer_group, c.rollout.engines
    infer_world = engines.count * engines.tensor_parallel
    if group.gpus_per_node and infer_world != group.gpus:
        yield Problem(
            "rollout.engines",
            f"AWEX colocate pairs each of the actor's {group.gpus} GPUs with one rollout rank, but "
            f"count·tensor_parallel = {engines.count}·{engines.tensor_parallel} = {infer_world}",
            infer_world,
            f"count·tensor_parallel = {group.gpus}, or rollout.mode: separated (AWEX separate mode)",
        )


@rule("loss")
def _kl_needs_rl(c: Any) -> Iterator[Problem]:
    if c.loss.kl_coefficient > 0 and c.loss.rl_coefficient == 0:
        yield Problem(
            "loss.kl_coefficient",
            "the KL penalty lives inside L_RL, which is off (loss.rl_coefficient is 0)",
            c.loss.kl_coefficient,
            "set loss.rl_coefficient > 0, or kl_coefficient: 0",
        )


@rule("loss", "data")
def _grpo_group(c: Any) -> Iterator[Problem]:
    uses_rewards = c.loss.rl_coefficient > 0 or c.loss.orm_alpha > 0
    if uses_rewards and c.data.samples_per_prompt < 2:
        yield Problem(
            "data.samples_per_prompt",
            "GRPO's group-normalized reward needs at least 2 samples per prompt "
            f"(loss.rl_coefficient {c.loss.rl_coefficient}, loss.orm_alpha {c.loss.orm_alpha})",
            c.data.samples_per_prompt,
            "2 or more, or no RL term",
        )


@rule("data", "seed", "steps")
def _eval_split(c: Any) -> Iterator[Problem]:
    """reasoning-gym seeds item i with Random(seed + i): the eval items must not reuse training seeds."""
    ev = c.data.eval
    train_end = c.seed + c.steps * c.data.batch_size
    if ev.size and ev.seed < train_end and c.seed < ev.seed + ev.size:
        below = f" or ≤ {c.seed - ev.size}" if c.seed - ev.size >= 0 else ""
        yield Problem(
            "data.eval.seed",
            f"held-out items [{ev.seed}, {ev.seed + ev.size}) overlap the training items [{c.seed}, {train_end})",
            ev.seed,
            f"a seed ≥ {train_end}{below}",
        )


@rule("models")
def _megatron_schedule(c: Any) -> Iterator[Problem]:
    """The megatron engine keeps Megatron's optimizer at a constant lr (no schedule wired in yet)."""
    actor = c.models.actor
    opt = actor.optimizer
    if actor.engine == "megatron" and (opt.schedule != "constant" or opt.warmup_ratio > 0):
        yield Problem(
            "models.actor.optimizer.schedule",
            f"the megatron engine trains at a constant lr (warmup_ratio {opt.warmup_ratio})",
            opt.schedule,
            "schedule: constant and warmup_ratio: 0 with engine: megatron, or engine: torch",
        )


def config_warnings(cfg: Any) -> list[str]:
    """Legal but suspicious settings of a valid RunConfig, rendered as problems (not errors); `job_gaps`
    first, as "not run by the job's roles yet: ..."."""
    out = [f"not run by the job's roles yet: {gap.render()}" for gap in job_gaps(cfg)]
    for i, teacher in enumerate(cfg.models.teachers):
        if not any(weights.get(teacher.id, 0) > 0 for weights in cfg.routes.values()):
            out.append(
                Problem(
                    join_path("models", "teachers", i),
                    f"teacher {teacher.id!r} has no weight > 0 in any route: it contributes nothing",
                    expected="remove it, or give it a weight",
                ).render()
            )
    out += [p.render() for p in unevaluated_sources(cfg.data)]
    if cfg.checkpoint_interval > cfg.steps:
        out.append(
            Problem(
                "checkpoint_interval",
                f"longer than the run ({cfg.steps} steps): no checkpoint before the end",
                cfg.checkpoint_interval,
            ).render()
        )
    return out
