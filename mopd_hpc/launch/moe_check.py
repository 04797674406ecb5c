"""What a mixture-of-experts actor checkpoint asks of the job that `--check` reads from its config.json
(issue 33): refusals, each naming its field and the way out.

- `weight_sync.backend` must move experts (`config.capabilities.WEIGHT_SYNCS[...].experts`); one whose expert
  transfer has not run on GPUs (`experts_untested`: AWEX into the hf engine's fused experts) is refused unverified,
  naming that test and the opt-in.
"""

from __future__ import annotations

from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.config.capabilities import WEIGHT_SYNCS, unverified
from mopd_hpc.config.problems import Problem


def moe_actor_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """The refusals of the module docstring for the MoE actor checkpoint `directory` (an `arch`)."""
    sync, spec = cfg.weight_sync.backend, WEIGHT_SYNCS[cfg.weight_sync.backend]
    if spec.experts and not spec.experts_untested:
        return []
    why = (
        f"has not moved experts on GPUs ({spec.experts_untested} has not run)"
        if spec.experts
        else ("does not move its experts")
    )
    problem = Problem(
        "weight_sync.backend",
        f"the actor ({directory}) is a mixture-of-experts {arch}: {sync} {why}",
        sync,
        f"weight_sync.backend: {_movers(cfg)}",
    )
    return [unverified(problem, spec.experts_untested) if spec.experts else problem]


def _movers(cfg: RunConfig) -> str:
    """The weight-sync backends that have moved experts and run this actor engine, rollout backend and layout."""
    layout = (cfg.rollout.mode, "gpu" if cfg.cluster.trainer_group.gpus_per_node else "cpu")
    names = [
        n
        for n, s in WEIGHT_SYNCS.items()
        if s.experts
        and not s.experts_untested
        and cfg.models.actor.engine in s.actor_engines
        and cfg.rollout.backend in s.rollout_backends
        and layout in s.layouts
    ]
    return " / ".join(names) or "none here"
