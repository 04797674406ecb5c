"""What the job's roles do not run yet (issue 8): `job_gaps(cfg)`, one `Problem` per valid setting that
`mopd-submit` refuses to run (re-exported by `config/rules.py`, whose `config_warnings` lists them first).

Each gap names the field, its value and the value the roles run, so the user can change that field (or
wait for the role that runs it) instead of getting a substitute engine silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mopd_hpc.config.parallel import actor_world
from mopd_hpc.config.problems import Problem, join_path


def job_gaps(cfg: Any) -> list[Problem]:
    """Valid settings that the job's roles do not run yet, one problem each (issue 8).

    The roles run: the torch actor on one process, or on several CPU ranks (data parallelism over the trainer
    slots, config/parallel.py: it has not run on GPUs yet), or the megatron actor at tensor_parallel,
    pipeline_parallel and data-parallel size 1 (one process); torch or
    megatron teachers at tensor_parallel 1; the HF rollout server; torch.distributed weight sync, or AWEX
    (colocate or separate mode) from the megatron actor to the HF server. The rest (tensor-parallel actors
    and teachers, SGLang in the rollout role) exists as components with their tests and benchmarks, but no
    role runs it: such a config passes --check, --dry-run, --render and --probe, and mopd-submit refuses to
    run it.
    """
    out = []
    actor = cfg.models.actor
    if actor.engine == "megatron" and actor.tensor_parallel != 1:
        out.append(
            Problem(
                "models.actor.tensor_parallel",
                "the actor role runs the megatron engine on one process: tensor_parallel > 1 needs ranks "
                "it does not start",
                actor.tensor_parallel,
                "expected 1",
            )
        )
    for i, teacher in enumerate(cfg.models.teachers):
        # the teacher role builds the torch or the megatron scoring engine (roles/teacher.py), one
        # process per teacher: a tensor-parallel teacher would need follower ranks the role does not start
        if teacher.tensor_parallel != 1:
            out.append(
                Problem(
                    join_path("models", "teachers", i, "tensor_parallel"),
                    f"the teacher role serves each teacher from one process: a {teacher.engine} teacher at "
                    "tensor_parallel > 1 needs follower ranks it does not start",
                    teacher.tensor_parallel,
                    "expected 1",
                )
            )
    if cfg.rollout.backend != "hf":
        out.append(
            Problem(
                "rollout.backend",
                "the rollout role runs the hf server only",
                cfg.rollout.backend,
                "expected 'hf'",
            )
        )
    if cfg.weight_sync.backend == "awex":
        out += _awex_gaps(cfg)
    return out + list(_actor_world_gaps(cfg))  # last: the refusals before issue 16 keep their order


def _actor_world_gaps(cfg: Any) -> Iterator[Problem]:
    """The actor beyond one rank: the torch engine has run data-parallel on CPU ranks only (gloo); the
    megatron engine has run on one GPU only (its TP, PP and DP runs are the multi-GPU issue's)."""
    actor, group = cfg.models.actor, cfg.cluster.trainer_group
    world = actor_world(cfg.cluster, cfg.rollout)
    if world.size <= 1:
        return
    one_slot = f"one trainer slot ({world.group_path}.nodes: 1 and gpus_per_node: 1)"
    if actor.engine == "torch" and group.gpus_per_node:
        yield Problem(
            "models.actor.engine",
            f"the torch actor has trained on several ranks on CPU only (gloo), not yet on GPUs: the actor has "
            f"{world.size} trainer ranks ({world.how})",
            actor.engine,
            f"{one_slot}, or CPU ranks ({world.group_path}.gpus_per_node: 0, actor_ranks_per_node)",
        )
    elif actor.engine == "megatron":
        if actor.pipeline_parallel != 1:
            yield Problem(
                "models.actor.pipeline_parallel",
                "the actor role runs the megatron engine on one process: pipeline_parallel > 1 needs ranks "
                "it does not start",
                actor.pipeline_parallel,
                "expected 1",
            )
        dp = world.size // (actor.tensor_parallel * actor.pipeline_parallel)
        if dp > 1:
            yield Problem(
                "models.actor.engine",
                f"the actor role runs the megatron engine on one process: data parallelism (dp {dp} = world "
                f"{world.size} / (tensor_parallel·pipeline_parallel), world = {world.how}) needs ranks it "
                "does not start",
                actor.engine,
                f"{one_slot}, or engine: torch on CPU ranks",
            )


def _awex_gaps(cfg: Any) -> Iterator[Problem]:
    """AWEX runs in the job from the megatron actor to the HF rollout server (colocate or separate mode)."""
    engine, backend = cfg.models.actor.engine, cfg.rollout.backend
    if engine != "megatron":
        yield Problem(
            "weight_sync.backend",
            f"the AWEX writer needs the megatron actor; models.actor.engine is {engine!r}",
            "awex",
            "models.actor.engine: megatron, or weight_sync.backend: torch",
        )
    if backend != "hf":
        yield Problem(
            "weight_sync.backend",
            f"the job's AWEX reader is the hf rollout server's (/awex/init); rollout.backend is {backend!r}",
            "awex",
            "rollout.backend: hf, or weight_sync.backend: torch",
        )
