"""What the actor role does not train, derived from the actor engines' declarations (config/capabilities.py
ACTOR_ENGINES): the `loss:` terms (`loss_refusals`), the lr schedule (`optimizer_refusals`), the actor's shape on
its device (`actor_refusals`: tensor, pipeline and data parallel) and the mixture-of-experts settings
(`moe_refusals`). Each refusal is a `Problem` naming the field, the value and the way out; one of code that has
not run on GPUs here is marked unverified (`capabilities.unverified`). Callers: config/job_gaps.py (at
--check), config/rules.py, the actor role and the train engines (their re-check at start).
"""

from __future__ import annotations

from typing import Any

from mopd_hpc.config.capabilities import (
    ACTOR_ENGINES,
    ROLLOUT_BACKENDS,
    device_kinds,
    other_ways,
    process_count,
    unverified,
)
from mopd_hpc.config.problems import Problem


def loss_refusals(engine: str, loss: Any, *, engine_only: bool = False) -> list[Problem]:
    """The `loss:` settings the job cannot train with the actor engine `engine` (paths `loss.*`), from its
    declaration; `engine_only`: only what the engine itself does not compute (its constructor's re-check: the
    reference log-probs of the KL penalty are an input the engine computes with, the job's roles supply them).

    A term is checked only when it is computed: the estimator when distillation_coefficient > 0, the
    advantage-level term when also orm_alpha > 0, the KL penalty when rl_coefficient > 0 (kl without RL is
    a config error of config/rules.py).
    """
    spec, out = ACTOR_ENGINES[engine], []
    actor = f"the {engine} actor engine"
    distill = loss.distillation_coefficient > 0
    if distill and loss.estimator not in spec.estimators:
        out.append(
            Problem(
                "loss.estimator",
                f"{actor} computes estimator {' / '.join(spec.estimators)} only",
                loss.estimator,
                f"loss.estimator: {spec.estimators[0]}"
                + other_ways(
                    ACTOR_ENGINES, "models.actor.engine", lambda s: loss.estimator in s.estimators, but=engine
                ),
            )
        )
    if loss.rl_coefficient > 0 and not spec.loss_rl:
        out.append(
            Problem(
                "loss.rl_coefficient",
                f"{actor} has no loss-level RL term (c_rl·L_GRPO)",
                loss.rl_coefficient,
                "rl_coefficient: 0 (loss.orm_alpha adds the reward at the advantage level)"
                + other_ways(ACTOR_ENGINES, "models.actor.engine", lambda s: s.loss_rl, but=engine),
            )
        )
    if distill and loss.orm_alpha > 0 and loss.estimator not in spec.advantage_rl:
        out.append(
            Problem(
                "loss.orm_alpha",
                f"the advantage-level composition A_t + α·A_ORM needs a per-token advantage: {actor} adds it "
                f"with estimator {' / '.join(spec.advantage_rl) or 'none'}, not {loss.estimator!r}",
                loss.orm_alpha,
                "orm_alpha: 0 (loss.rl_coefficient adds the reward as a loss term), or loss.estimator: "
                + " / ".join(spec.advantage_rl),
            )
        )
    if loss.rl_coefficient > 0 and loss.kl_coefficient > 0 and not spec.reference and not engine_only:
        out.append(
            Problem(
                "loss.kl_coefficient",
                f"the KL penalty needs a reference model's log-probs, and the job scores none for {actor}",
                loss.kl_coefficient,
                "kl_coefficient: 0"
                + other_ways(ACTOR_ENGINES, "models.actor.engine", lambda s: s.reference, but=engine),
            )
        )
    return out


def optimizer_refusals(engine: str, optimizer: Any) -> list[Problem]:
    """The lr schedule the actor engine `engine` does not apply (path models.actor.optimizer.schedule)."""
    spec = ACTOR_ENGINES[engine]
    if optimizer.schedule in spec.schedules and (spec.warmup or optimizer.warmup_ratio == 0):
        return []
    return [
        Problem(
            "models.actor.optimizer.schedule",
            f"the {engine} engine trains at "
            + (
                "a constant lr "
                if spec.schedules == ("constant",)
                else f"schedule {' / '.join(spec.schedules)} "
            )
            + f"(warmup_ratio {optimizer.warmup_ratio})",
            optimizer.schedule,
            f"schedule: {spec.schedules[0]}{'' if spec.warmup else ' and warmup_ratio: 0'} "
            f"with engine: {engine}"
            + other_ways(
                ACTOR_ENGINES, "engine", lambda s: s.warmup and optimizer.schedule in s.schedules, but=engine
            ),
        )
    ]


def actor_refusals(
    engine: str,
    device: str,
    world: int,
    tp: int,
    pp: int,
    *,
    how: str = "",
    group_path: str = "cluster.<group>",
) -> list[Problem]:
    """The actor shape the role does not run with engine `engine`: `world` ranks on `device` ("cpu"/"gpu")
    at tensor_parallel `tp` and pipeline_parallel `pp` (dp = world / (tp·pp)); `how` says how the world was
    counted, `group_path` is the trainer group's YAML path (for the way out)."""
    spec, out = ACTOR_ENGINES[engine], []
    if device not in spec.devices:
        return [
            Problem(
                "models.actor.engine",
                f"the {engine} engine trains on {device_kinds(spec.devices)} only; the actor's device is a "
                f"{device.upper()}",
                engine,
                f"a {device_kinds(spec.devices)} group ({group_path}.gpus_per_node)"
                + other_ways(ACTOR_ENGINES, "engine", lambda s: device in s.devices, but=engine),
            )
        ]
    if tp > spec.tensor_parallel:
        why = (
            f"tensor_parallel {tp} has not run with this engine yet: {spec.untested} has not run"
            if spec.untested
            else f"tensor_parallel {tp} needs ranks it does not start"
        )
        problem = Problem(
            "models.actor.tensor_parallel",
            f"the actor role runs the {engine} engine at tensor_parallel ≤ {spec.tensor_parallel} "
            f"({process_count(spec.tensor_parallel)}): {why}",
            tp,
            f"expected ≤ {spec.tensor_parallel}",
        )
        out.append(unverified(problem, spec.untested) if "tensor_parallel" in spec.unverified else problem)
    if pp > spec.pipeline_parallel:
        out.append(
            Problem(
                "models.actor.pipeline_parallel",
                f"the actor role runs the {engine} engine at pipeline_parallel ≤ {spec.pipeline_parallel}: "
                f"pipeline_parallel {pp} needs ranks it does not start",
                pp,
                f"expected ≤ {spec.pipeline_parallel}",
            )
        )
    dp, limit = world // max(1, tp * pp), spec.data_parallel(device)
    if limit is not None and dp > limit:
        slots = "one trainer slot" if limit * tp * pp == 1 else f"at most {limit * tp * pp} trainer slots"
        per_node = "gpus_per_node" if device == "gpu" else "actor_ranks_per_node"
        ways = [f"{slots} ({group_path}.nodes × {per_node})"]
        if device == "gpu" and "cpu" in spec.devices and spec.data_parallel_cpu is None:
            ways.append(f"CPU ranks ({group_path}.gpus_per_node: 0, actor_ranks_per_node)")
        for other in ACTOR_ENGINES.values():
            other_limit = other.data_parallel(device)
            if other.name == engine:
                continue
            if device in other.devices and (other_limit is None or other_limit >= dp):
                ways.append(f"engine: {other.name}")
            elif device == "gpu" and "cpu" in other.devices and other.data_parallel_cpu is None:
                ways.append(f"engine: {other.name} on CPU ranks")
        problem = Problem(
            "models.actor.engine",
            f"the actor role runs the {engine} engine at data-parallel size ≤ {limit} on "
            f"{device.upper()}s: the actor "
            f"has {world} trainer ranks{f' ({how})' if how else ''}, dp {dp} = world / "
            f"(tensor_parallel·pipeline_parallel)"
            + (f"; more has not run yet: {spec.untested}" if spec.untested else ""),
            engine,
            ", or ".join(ways),
        )
        written = f"data_parallel_{device}" in spec.unverified
        out.append(unverified(problem, spec.untested) if written else problem)
    return out


def moe_refusals(
    engine: str, rollout_backend: str, loss: Any, routing_replay: bool, expert_parallel: int, **shape: Any
) -> list[Problem]:
    """The mixture-of-experts settings the actor engine `engine` and the rollout `rollout_backend` do not run:
    the router losses, rollout routing replay, an expert-parallel size above the declared one
    (`expert_parallel_refusals`, with `shape`: unverified where the engine's code goes beyond it, and refused
    where it cannot run). Whether the actor has routers at all, and how many experts, is the model check's
    (launch/model_check.py)."""
    spec, out = ACTOR_ENGINES[engine], []
    aux = loss.router_aux_loss_coefficient
    if not spec.router_losses and ((aux or 0.0) > 0 or loss.router_z_loss_coefficient > 0):
        field = "router_aux_loss_coefficient" if (aux or 0.0) > 0 else "router_z_loss_coefficient"
        out.append(
            Problem(
                f"loss.{field}",
                f"the {engine} actor engine adds no router loss (its MoE layers' own aux loss is off)",
                getattr(loss, field),
                "0" + other_ways(ACTOR_ENGINES, "models.actor.engine", lambda s: s.router_losses, but=engine),
            )
        )
    if routing_replay and not spec.routing_replay:
        out.append(
            Problem(
                "rollout.routing_replay",
                f"the {engine} actor engine does not replay the rollout's routed experts",
                True,
                "false"
                + other_ways(ACTOR_ENGINES, "models.actor.engine", lambda s: s.routing_replay, but=engine),
            )
        )
    if routing_replay and not ROLLOUT_BACKENDS[rollout_backend].routed_experts:
        out.append(
            Problem(
                "rollout.routing_replay",
                f"the {rollout_backend} rollout backend does not answer the routed experts of its tokens",
                True,
                "false"
                + other_ways(
                    ROLLOUT_BACKENDS, "rollout.backend", lambda s: s.routed_experts, but=rollout_backend
                ),
            )
        )
    return out + expert_parallel_refusals(engine, expert_parallel, loss, **shape)


def expert_parallel_refusals(
    engine: str,
    expert_parallel: int,
    loss: Any,
    *,
    world: int = 1,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    weight_sync: str = "torch",
) -> list[Problem]:
    """`models.actor.expert_parallel` = EP > 1 where the actor engine `engine` has not run it: unverified when
    its code is written (`"expert_parallel"` in the engine's `unverified`: megatron's EP group,
    engines/megatron/expert_parallel.py; the GPU test that has not run is `expert_parallel_untested`), and
    refused where it cannot run: EP not dividing the data-parallel size world / (TP·PP) (megatron forms the EP
    group within the DP ranks), tensor_parallel > 1 (the gathers of every expert are written for TP 1), the
    KL penalty's reference model (a scoring engine per rank, whose forwards would be collectives over the EP
    group at each rank's own pace) and the AWEX weight sync (its plan has no expert shards). Whether EP divides
    the expert count needs the checkpoint's config.json: launch/model_check.py."""
    spec = ACTOR_ENGINES[engine]
    if expert_parallel <= spec.expert_parallel:
        return []
    field = "models.actor.expert_parallel"
    if "expert_parallel" not in spec.unverified:
        why = (
            "it builds no expert-parallel group (every rank holds every expert; a larger size is not written)"
        )
        way = f"expected ≤ {spec.expert_parallel}" + other_ways(
            ACTOR_ENGINES, "models.actor.engine", lambda s: "expert_parallel" in s.unverified, but=engine
        )
        return [
            Problem(field, f"the actor role runs the {engine} engine at expert_parallel ≤ {spec.expert_parallel}: "
                    f"{why}", expert_parallel, way)
        ]  # fmt: skip
    out = []
    dp = world // max(tensor_parallel * pipeline_parallel, 1)
    if world > 0 and dp % expert_parallel:
        out.append(
            Problem(
                field,
                f"the expert-parallel group is formed within the data-parallel ranks: {expert_parallel} does not "
                f"divide the actor's data-parallel size {dp} (its {world} trainer ranks / (tensor_parallel "
                f"{tensor_parallel} · pipeline_parallel {pipeline_parallel}))",
                expert_parallel,
                f"a divisor of {dp}, or more trainer GPUs",
            )
        )
    blockers = [
        (f"models.actor.tensor_parallel {tensor_parallel}", tensor_parallel > 1, "every expert is gathered over the EP group at "
         "tensor_parallel 1 only", "tensor_parallel: 1, or expert_parallel: 1"),
        (f"loss.kl_coefficient {loss.kl_coefficient}", loss.kl_coefficient > 0, "the KL penalty's reference model scores each rank's "
         "rows at its own pace, and an expert-parallel forward is a collective over the EP group",
         "kl_coefficient: 0, or expert_parallel: 1"),
        ("weight_sync.backend awex", weight_sync == "awex", "AWEX's transfer plan has no expert shards (each rank "
         "would publish its own experts only)", "torch or ipc, or expert_parallel: 1"),
    ]  # fmt: skip
    for path, blocked, why, way in blockers:
        if blocked:
            out.append(
                Problem(field, f"expert_parallel {expert_parallel} with {path}: {why}", expert_parallel, way)
            )
    if not out:
        problem = Problem(
            field,
            f"the {engine} actor at expert_parallel > {spec.expert_parallel} has not run on GPUs "
            f"({spec.expert_parallel_untested})",
            expert_parallel,
            f"expert_parallel: {spec.expert_parallel}",
        )
        out.append(unverified(problem, spec.expert_parallel_untested))
    return out
