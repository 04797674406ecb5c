"""What a mixture-of-experts actor checkpoint asks of the job that `--check` reads from its config.json
(issue 33): refusals, each naming its field and the way out.

- `weight_sync.backend` must move experts (`config.capabilities.WEIGHT_SYNCS[...].experts`): AWEX pairs the
  trainer's and the rollout's parameters name by name, and a megatron actor's per-expert tensors have no
  pair among the hf engine's fused ones.
"""

from __future__ import annotations

from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.config.capabilities import WEIGHT_SYNCS
from mopd_hpc.config.problems import Problem


def moe_actor_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """The refusals of the module docstring for the MoE actor checkpoint `directory` (an `arch`)."""
    out, engine = [], cfg.models.actor.engine
    sync = cfg.weight_sync.backend
    if not WEIGHT_SYNCS[sync].experts:
        layout = (cfg.rollout.mode, "gpu" if cfg.cluster.trainer_group.gpus_per_node else "cpu")
        movers = (
            " / ".join(
                n
                for n, s in WEIGHT_SYNCS.items()
                if s.experts
                and engine in s.actor_engines
                and cfg.rollout.backend in s.rollout_backends
                and layout in s.layouts
            )
            or "none here"
        )
        out.append(
            Problem(
                "weight_sync.backend",
                f"the actor ({directory}) is a mixture-of-experts {arch}: {sync} does not move its experts "
                "(it pairs the trainer's and the rollout's parameters name by name; the hf engine holds a "
                "layer's experts fused)",
                sync,
                f"weight_sync.backend: {movers}",
            )
        )
    return out
