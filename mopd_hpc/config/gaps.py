"""What the job's roles do not run yet (issue 8): `job_gaps(cfg)`, one `Problem` per valid setting that
`mopd-submit` refuses to run (re-exported by `config/rules.py`, whose `config_warnings` lists them first).

Each gap names the field, its value and the value the roles run, so the user can change that field (or
wait for the role that runs it) instead of getting a substitute engine silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mopd_hpc.config.problems import Problem, join_path


def job_gaps(cfg: Any) -> list[Problem]:
    """Valid settings that the job's roles do not run yet, one problem each (issue 8).

    The roles run: the torch actor, or the megatron actor at tensor_parallel 1 (one process); torch or
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
    return out + list(_awex_gaps(cfg)) if cfg.weight_sync.backend == "awex" else out


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
