"""What an actor checkpoint asks of the weight sync, which `--check` reads from its config.json (issue 33):
refusals, each naming its field and the way out.

- `weight_sync.backend` must convert the checkpoint's family (`config.capabilities.WEIGHT_SYNCS[...].architectures`:
  AWEX's converters are registered by architecture, Llama has none) (`sync_family_problems`);
- for a mixture of experts (`moe_actor_problems`), `weight_sync.backend` must move experts
  (`config.capabilities.WEIGHT_SYNCS[...].experts`); one whose expert transfer has not run on GPUs
  in this rollout.mode (`experts_untested`: AWEX into the hf engine's fused experts, separated) is refused
  unverified, naming that test and the opt-in.
"""

from __future__ import annotations

from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.config.capabilities import WEIGHT_SYNCS, unverified
from mopd_hpc.config.problems import Problem


def moe_actor_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """The refusals of the module docstring for the MoE actor checkpoint `directory` (an `arch`)."""
    sync, spec = cfg.weight_sync.backend, WEIGHT_SYNCS[cfg.weight_sync.backend]
    untested = spec.experts_untested_in(cfg.rollout.mode)
    if spec.experts and not untested:
        return []
    why = (
        f"has not moved experts on GPUs with rollout.mode {cfg.rollout.mode} ({untested} has not run)"
        if spec.experts
        else ("does not move its experts")
    )
    problem = Problem(
        "weight_sync.backend",
        f"the actor ({directory}) is a mixture-of-experts {arch}: {sync} {why}",
        sync,
        f"weight_sync.backend: {_movers(cfg, arch, moe=True)}",
    )
    return [unverified(problem, untested) if spec.experts else problem]


def sync_family_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """The refusal of a `weight_sync.backend` that does not convert the actor checkpoint `directory` (an `arch`)."""
    sync, spec = cfg.weight_sync.backend, WEIGHT_SYNCS[cfg.weight_sync.backend]
    if spec.architectures is None or arch in spec.architectures:
        return []
    problem = Problem(
        "weight_sync.backend",
        f"the actor ({directory}) is a {arch}: {sync} converts {' / '.join(spec.architectures)} checkpoints only",
        sync,
        f"weight_sync.backend: {_movers(cfg, arch, moe=False)}",
    )
    return [problem]


def _movers(cfg: RunConfig, arch: str, moe: bool) -> str:
    """The weight-sync backends that convert `arch`, have moved experts (`moe`) and run this actor engine,
    rollout backend and layout."""
    layout = (cfg.rollout.mode, "gpu" if cfg.cluster.trainer_group.gpus_per_node else "cpu")
    names = [
        n
        for n, s in WEIGHT_SYNCS.items()
        if (not moe or (s.experts and not s.experts_untested_in(cfg.rollout.mode)))
        and (s.architectures is None or arch in s.architectures)
        and cfg.models.actor.engine in s.actor_engines
        and cfg.rollout.backend in s.rollout_backends
        and layout in s.layouts
    ]
    return " / ".join(names) or "none here"
