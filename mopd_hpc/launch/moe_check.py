"""What an actor checkpoint asks of the weight sync, which `--check` reads from its config.json (issue 33):
refusals, each naming its field and the way out.

- `weight_sync.backend` must convert the checkpoint's family (`config.capabilities.WEIGHT_SYNCS[...].architectures`:
  AWEX's converters are registered by architecture, Llama has none) (`sync_family_problems`);
- for a mixture of experts (`moe_actor_problems`), `weight_sync.backend` must move experts
  (`config.capabilities.WEIGHT_SYNCS[...].experts`); one whose expert transfer has not run on GPUs
  in this rollout.mode (`experts_untested`: AWEX into the hf engine's fused experts, separated) is refused
  unverified, naming that test and the opt-in;
- `models.actor.expert_parallel` must divide the checkpoint's expert count (`expert_count_problems`: each EP
  rank holds E/EP experts of each MoE layer).
"""

from __future__ import annotations

import json
from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.config.capabilities import WEIGHT_SYNCS, unverified
from mopd_hpc.config.problems import Problem


def moe_actor_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """The refusals of the module docstring for the MoE actor checkpoint `directory` (an `arch`)."""
    return _expert_sync_problems(cfg, arch, directory) + expert_count_problems(cfg, arch, directory)


def expert_count_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """`models.actor.expert_parallel` not dividing the expert count E of config.json (`num_experts`, or
    `num_local_experts` as transformers 5 writes it); nothing when config.json does not say E."""
    ep = cfg.models.actor.expert_parallel
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if ep <= 1 or not experts or experts % ep == 0:
        return []
    divisors = [d for d in range(2, experts + 1) if experts % d == 0 and d <= 64][:6]
    return [
        Problem(
            "models.actor.expert_parallel",
            f"the actor ({directory}) is a {arch} of {experts} experts a layer: {ep} ranks cannot hold an "
            "equal share of them",
            ep,
            f"a divisor of {experts} ({', '.join(map(str, divisors))}, ...), or 1",
        )
    ]


def _expert_sync_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """The weight sync's refusal for a MoE actor (module docstring)."""
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
