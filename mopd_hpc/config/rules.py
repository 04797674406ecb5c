"""Cross-section rules of the run config: everything that needs two sections to decide.

Rules inside one section live in that section's validator. Each rule here declares the sections it
reads; the loader runs every rule whose sections are valid, even when other sections are not, so one
`ConfigError` lists every problem it can find. Paths are absolute.

Decisions (documented here, tested in tests/config/test_config_errors.py):
- a route that no source uses is an ERROR (most often a typo in a source's `route`; an unused route
  would load and score its teachers for nothing);
- a teacher with no positive weight in any route is a WARNING (`config_warnings`): it is how a user
  switches a teacher off with `--set routes.R.T=0` for one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mopd_hpc.config.actor_refusals import optimizer_refusals
from mopd_hpc.config.capabilities import ACTOR_ENGINES, ROLLOUT_BACKENDS
from mopd_hpc.config.data import unevaluated_sources
from mopd_hpc.config.job_gaps import backend_package_warning, job_gaps, unverified_gaps, unverified_warning
from mopd_hpc.config.parallel import actor_world, divisors, indivisible_message
from mopd_hpc.config.problems import Problem, join_path, known, needs_gpus
from mopd_hpc.config.teacher_rules import teacher_layout, teacher_residency, teachers_started
from mopd_hpc.config.weight_sync_rules import awex_backend, awex_colocate

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


def _parallel_problems(
    path: str, tp: int, pp: int, gpus_per_node: int, gpus: int, group_path: str, gpus_label: str = ""
) -> Iterator[Problem]:
    """tp must divide the group's GPUs per node (TP stays inside a node); tp·pp must divide its GPUs."""
    if gpus_per_node == 0:
        if tp > 1:
            yield needs_gpus(f"{path}.tensor_parallel", "tensor parallelism", tp, group_path)
        if pp > 1:
            yield needs_gpus(f"{path}.pipeline_parallel", "pipeline parallelism", pp, group_path)
        return
    if gpus_per_node % tp:
        yield Problem(
            f"{path}.tensor_parallel",
            f"must divide {group_path}.gpus_per_node ({gpus_per_node})",
            tp,
            f"a divisor of the GPUs per node: {divisors(gpus_per_node)}",
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


@rule("models", "cluster", "rollout")
def _actor_layout(c: Any) -> Iterator[Problem]:
    """The actor's sizes fit its trainer slots (config/parallel.py): on CPU no TP or PP; on GPUs TP within a
    node and tp·pp dividing the actor's world (torchtitan ParallelDims: dp = world / (tp·pp) is whole)."""
    actor, group = c.models.actor, c.cluster.trainer_group
    world = actor_world(c.cluster, c.rollout)
    where = world.group_path
    if "cpu" not in ACTOR_ENGINES[actor.engine].devices and group.gpus_per_node == 0:
        yield needs_gpus(
            "models.actor.engine", f"the {actor.engine} engine", actor.engine, where, "use engine: torch"
        )
        return
    if group.gpus_per_node and world.size <= 0:
        yield Problem(
            "rollout.engines",
            f"rollout engines take all {group.gpus} GPUs of {where}, none left for the actor",
            c.rollout.engines.count * c.rollout.engines.tensor_parallel,
            "fewer engines, or rollout.mode: colocated",
        )
        return
    tp, pp = actor.tensor_parallel, actor.pipeline_parallel
    if group.gpus_per_node == 0 or group.gpus_per_node % tp:
        yield from _parallel_problems("models.actor", tp, pp, group.gpus_per_node, world.size, where)
    elif world.size % (tp * pp):
        label = (
            " = nodes·gpus_per_node" if world.size == group.gpus else " left after the rollout engines' GPUs"
        )
        yield Problem(
            "models.actor",
            f"tensor_parallel·pipeline_parallel = {tp}·{pp} = {tp * pp} must divide the GPUs of {where} "
            f"({world.size}{label}): {indivisible_message(world.size, tp, pp)} ({world.how})",
            tp * pp,
            f"tensor_parallel·pipeline_parallel among {divisors(world.size)}, or change the trainer slots",
        )


rule("models", "cluster", "rollout")(teacher_layout)
rule("models", "cluster")(teacher_residency)
rule("cluster", "loss")(teachers_started)


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
    if "cpu" not in ROLLOUT_BACKENDS[rollout.backend].devices and group.gpus_per_node == 0:
        yield needs_gpus(
            "rollout.backend", f"the {rollout.backend} backend", rollout.backend, where, "use backend: hf"
        )
        return
    engines, tp = rollout.engines, rollout.engines.tensor_parallel
    per_node = group.gpus_per_node - group.teacher_gpus  # the teachers' own GPUs are not the engines'
    gpus, label = group.nodes * per_node, f"the {group.nodes * per_node} GPUs of {where}"
    if group.teacher_gpus:
        label += " not the teachers' own"
        if per_node % tp:
            yield Problem(
                "rollout.engines.tensor_parallel",
                f"must divide the GPUs per node the teachers leave ({where}.gpus_per_node − "
                f"teacher_gpus_per_node = {per_node})",
                tp,
                f"a divisor of {per_node}: {divisors(per_node)}",
            )
    else:
        yield from _parallel_problems("rollout.engines", tp, 1, group.gpus_per_node, group.gpus, where)
    # an engine wider than the whole group is the tensor_parallel problem above, not a count problem
    if group.gpus_per_node and tp <= gpus and engines.count * tp > gpus:
        yield Problem(
            "rollout.engines.count",
            f"count·tensor_parallel = {engines.count}·{tp} exceeds {label}",
            engines.count,
            f"at most {gpus // tp}",
        )


rule("weight_sync", "rollout", "models")(awex_backend)


@rule("weight_sync", "cluster")
def _ipc_one_node(c: Any) -> Iterator[Problem]:
    """The ipc sync shares memory between the actor's rank 0 and every rollout engine: all on one node
    (rollout.mode colocated is `weight_sync_refusals`' problem)."""
    group = c.cluster.rollout_group
    if c.weight_sync.backend == "ipc" and group.nodes > 1:
        yield Problem(
            f"{_rollout_path(c.cluster)}.nodes",
            "weight_sync.backend ipc shares the actor's memory with the rollout engines of its node only",
            group.nodes,
            "1, or weight_sync.backend: awex (colocate mode, megatron actor)",
        )


rule("weight_sync", "rollout", "cluster")(awex_colocate)


@rule("loss")
def _kl_needs_rl(c: Any) -> Iterator[Problem]:
    if c.loss.kl_coefficient > 0 and c.loss.rl_coefficient == 0:
        yield Problem(
            "loss.kl_coefficient",
            "the KL penalty lives inside L_RL, which is off (loss.rl_coefficient is 0)",
            c.loss.kl_coefficient,
            "set loss.rl_coefficient > 0, or kl_coefficient: 0",
        )


@rule("rollout", "cluster")
def _replay_uncompiled(c: Any) -> Iterator[Problem]:
    """Rollout routing replay records the experts in the hf engine's eager loop decoder: the compiled decode
    step (compile_decode, on a GPU rollout group) would not run, so asking for both is refused."""
    rollout = c.rollout
    gpu = c.cluster.rollout_group.gpus_per_node > 0
    if rollout.routing_replay and rollout.compile_decode and rollout.backend == "hf" and gpu:
        yield Problem(
            "rollout.compile_decode",
            "rollout.routing_replay records the routed experts in the hf engine's eager loop decoder: the "
            "compiled decode step would not run",
            True,
            "compile_decode: false with routing_replay: true",
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
def _engine_schedule(c: Any) -> Iterator[Problem]:
    """The lr schedule the actor engine applies (config/capabilities.py `schedules`, `warmup`)."""
    yield from optimizer_refusals(c.models.actor.engine, c.models.actor.optimizer)


@rule("loss", "steps")
def _sft_warmup(c: Any) -> Iterator[Problem]:
    """SFT warm-up steps are steps of the run: more than `steps` would never end the warm-up (a
    `loss.sft_warmup_ratio` ≤ 1 gives at most `steps`)."""
    if c.loss.sft_warmup_steps > c.steps:
        yield Problem(
            "loss.sft_warmup_steps",
            f"{c.loss.sft_warmup_steps} SFT warm-up steps in a run of {c.steps} steps",
            c.loss.sft_warmup_steps,
            f"at most steps ({c.steps})",
        )


def _cpu_budget(cfg: Any) -> Iterator[Problem]:
    """The actor ranks of a CPU node train at the same time, on the node's cpus_per_task CPUs (one task per
    node; its children share them): more ranks than CPUs means more threads than cores, which spin-wait
    (roles/env.py cpu_threads: each rank takes at least one thread)."""
    group = cfg.cluster.trainer_group
    ranks = group.actor_slots_per_node
    if group.gpus_per_node == 0 and ranks > group.cpus_per_task:
        where = "cluster.trainer" if cfg.cluster.shape == "heterogeneous" else "cluster.group"
        yield Problem(
            f"{where}.actor_ranks_per_node",
            f"{ranks} actor ranks train at the same time on each node's {group.cpus_per_task} CPU(s) "
            f"({where}.cpus_per_task): more threads than cores slow every step",
            ranks,
            f"at most {group.cpus_per_task}, or cpus_per_task ≥ {ranks}",
        )


#: The warning of an opt-in that lets no setting of the config through (a checkpoint's family may still: the
#: model check, launch/model_check.py, which reads the files, drops it then).
NOTHING_LET_THROUGH = "allow_unverified: true lets nothing through here: every setting of this config has run"


def config_warnings(cfg: Any) -> list[str]:
    """Legal but suspicious settings of a valid RunConfig, rendered as problems (not errors); `job_gaps`
    first, as "not run by the job's roles yet: ..."."""
    out = [f"not run by the job's roles yet: {gap.render()}" for gap in job_gaps(cfg)]
    let_through = unverified_gaps(cfg)
    out += [f"unverified: {unverified_warning(gap)}" for gap in let_through]
    if cfg.allow_unverified and not let_through:
        out.append(NOTHING_LET_THROUGH)
    out += backend_package_warning(cfg)
    backend = ROLLOUT_BACKENDS[cfg.rollout.backend]
    if cfg.rollout.mode in backend.stand_in_modes:
        where = (
            "this machine" if cfg.cluster.backend == "local" else "the rollout nodes (not checked from here)"
        )
        out.append(
            Problem(
                "rollout.backend",
                f"the {backend.name} backend has been tested with a stand-in for its engine only in rollout "
                f"mode {cfg.rollout.mode}, not yet with {backend.package}{backend.version_range} itself (that "
                f"needs 2 GPUs; the one-GPU colocated mode has run with it); {backend.package} must import on "
                f"{where}",
                backend.name,
            ).render()
        )
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
    out += [p.render() for p in _cpu_budget(cfg)]
    if cfg.checkpoint_interval > cfg.steps:
        out.append(
            Problem(
                "checkpoint_interval",
                f"longer than the run ({cfg.steps} steps): no checkpoint before the end",
                cfg.checkpoint_interval,
            ).render()
        )
    return out
